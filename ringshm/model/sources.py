"""Where a checkpoint's tensors come from: a GGUF file (``GGUFSource``: the cached ``GGUFIndex`` and the file's
memory map) or an HF directory's ``*.safetensors`` (``HFSource``), behind one small interface (``Source``), and the
``ModelConfig`` each one's metadata describes (``ringshm.model.families`` reads it).

Linear weights stay in their encoding where the matmul reads it (``RawWeight``; a GGUF tensor is then a view of
the memory map: no copy, and the stages of one engine share the page cache); other GGUF types are dequantized to
fp32 on demand (``ringshm.model.dequant``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Protocol

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from ringshm.config import ModelConfig
from ringshm.errors import MissingTensor
from ringshm.model import families
from ringshm.model.dequant import dequantize
from ringshm.model.gguf_index import GGUFIndex
from ringshm.model.qmatmul import RawWeight, native_ok


class Source(Protocol):
    path: Path

    def has(self, name: str) -> bool: ...

    def names_under(self, prefix: str) -> list[str]: ...

    def held_bytes(self, name: str, native: bool, width: float) -> tuple[int, bool]: ...

    def type_name(self, name: str) -> str: ...

    def stored_bytes(self, name: str) -> int: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_raw(self, name: str) -> RawWeight: ...


class GGUFSource:
    """Tensors of a GGUF file, dequantized to fp32 on demand. The metadata and tensor table come from the
    cached ``GGUFIndex`` (parsing a GGUF takes seconds); tensor bytes are memory-mapped and read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = GGUFIndex.open(path)

    def meta(self, key: str, default=None):
        return self.index.meta.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.index.tensors

    def names_under(self, prefix: str) -> list[str]:
        return [n for n in self.index.tensors if n.startswith(prefix)]

    def type_name(self, name: str) -> str:
        return GGMLQuantizationType(self.index.tensors[name].qtype).name

    def stored_bytes(self, name: str) -> int:
        return self.index.tensors[name].n_bytes

    def held_bytes(self, name: str, native: bool, width: float) -> tuple[int, bool]:
        """(bytes a stage holds for tensor ``name``, whether it is expanded at load): its stored bytes when the
        matmul reads its encoding (``native`` stages), else ``width`` bytes per weight (fp32 on CPU)."""
        t = self.index.tensors[name]
        n_el = 1
        for d in t.shape:
            n_el *= d
        if native and (len(t.shape) != 2 or native_ok(t.qtype, t.shape[1], t.shape[0])):
            return (t.n_bytes if len(t.shape) == 2 else n_el * 4), False
        return int(n_el * width), len(t.shape) == 2

    def get(self, name: str) -> torch.Tensor:
        t = self.index.tensors[name]
        shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
        return dequantize(self.index.raw(name), t.qtype, shape, name=name)

    def get_raw(self, name: str) -> RawWeight:
        """A 2-D tensor in its encoding when the matmul reads it (a view of the memory map), else as F32."""
        t = self.index.tensors[name]
        if len(t.shape) != 2:
            raise MissingTensor(f"tensor {name!r} in {self.path} is {len(t.shape)}-D, expected a 2-D weight")
        k, n = t.shape  # GGUF order: innermost (K) first
        if native_ok(t.qtype, n, k):
            with warnings.catch_warnings():  # a read-only map: the kernels only read it
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                data = torch.from_numpy(self.index.raw(name))
            return RawWeight.from_bytes(t.qtype, n, k, data)
        return RawWeight.from_tensor(self.get(name))


class HFSource:
    """Tensors of an HF directory's ``*.safetensors`` files, opened lazily by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file_of: dict[str, Path] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise MissingTensor(f"no *.safetensors files in {path}")
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    self.file_of[k] = f

    def has(self, name: str) -> bool:
        return name in self.file_of

    def names_under(self, prefix: str) -> list[str]:
        return [n for n in self.file_of if n.startswith(prefix)]

    def type_name(self, name: str) -> str:
        with safe_open(str(self.file_of[name]), framework="pt") as st:
            return st.get_slice(name).get_dtype()

    def stored_bytes(self, name: str) -> int:
        with safe_open(str(self.file_of[name]), framework="pt") as st:
            sl = st.get_slice(name)
            n = 1
            for d in sl.get_shape():
                n *= d
            return n * {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(sl.get_dtype(), 1)

    def held_bytes(self, name: str, native: bool, width: float) -> tuple[int, bool]:
        """As ``_GGUFSource.held_bytes``: F32 / F16 / BF16 weights stay as stored on native stages."""
        with safe_open(str(self.file_of[name]), framework="pt") as st:
            sl = st.get_slice(name)
            shape, dtype = sl.get_shape(), sl.get_dtype()
        n_el = 1
        for d in shape:
            n_el *= d
        stored = {"F32": 4, "F16": 2, "BF16": 2}.get(dtype)
        if native and stored is not None:
            return n_el * stored, False
        return int(n_el * (width if native or len(shape) == 2 else 4)), native and len(shape) == 2

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.file_of[name]), framework="pt") as st:
            return st.get_tensor(name)

    def get_raw(self, name: str) -> RawWeight:
        """F32 / F16 / BF16 weights as stored (no fp32 copy of a bf16 checkpoint); other dtypes as F32."""
        w = self.get(name)
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            w = w.float()
        return RawWeight.from_tensor(w)


def gguf_model_config(src: GGUFSource) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file's metadata and tensor table (``families.gguf_config``)."""
    arch = src.meta("general.architecture")
    vocab = src.meta(f"{arch}.vocab_size")
    if vocab is None:
        vocab = src.index.array_lengths.get("tokenizer.ggml.tokens")
        if vocab is None and src.has("token_embd.weight"):
            vocab = int(src.index.tensors["token_embd.weight"].shape[1])
    rope_freqs = src.get("rope_freqs.weight").tolist() if src.has("rope_freqs.weight") else None
    keys = dict(src.index.meta)
    keys.update({k: None for k in src.index.array_lengths if k not in keys})  # long arrays are audited by name
    return families.gguf_config(keys, set(src.index.tensors), arch, str(src.path), int(vocab or 0), rope_freqs)


def hf_model_config(path: Path) -> ModelConfig:
    """The ``ModelConfig`` of an HF directory's ``config.json`` (``families.hf_config``)."""
    return families.hf_config(json.loads((path / "config.json").read_text()), str(path / "config.json"))
