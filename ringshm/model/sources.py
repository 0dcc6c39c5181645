"""Where a checkpoint's tensors come from: a GGUF file (``GGUFSource``: its ``GGUFIndex`` and the file's memory
map) or an HF directory's ``*.safetensors`` (``HFSource``: its ``HFIndex``), behind one small interface
(``Source``). Both are built from the index the checkpoint check read (``ringshm.model.checkpoint_check``).

Linear weights stay in their encoding where the matmul reads it (``RawWeight``; a GGUF tensor is then a view of
the memory map: no copy, and the stages of one engine share the page cache); other GGUF types are dequantized to
fp32 on demand (``ringshm.model.dequant``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Protocol

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from ringshm.model.dequant import dequantize
from ringshm.model.families import HF_MXFP4_SUFFIXES
from ringshm.model.gguf_index import GGUFIndex
from ringshm.model.hf_index import HFIndex
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
    """Tensors of a GGUF file, dequantized to fp32 on demand. The metadata and tensor table come from its
    ``GGUFIndex``; tensor bytes are memory-mapped and read lazily."""

    def __init__(self, path: Path, index: GGUFIndex) -> None:
        self.path, self.index = path, index

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
        weight = len(t.shape) in (2, 3)  # a matmul's [N, K], or routed experts' [E, N, K]
        if native and (not weight or native_ok(t.qtype, t.shape[1], t.shape[0])):
            return (t.n_bytes if weight else n_el * 4), False
        return int(n_el * width), weight

    def get(self, name: str) -> torch.Tensor:
        t = self.index.tensors[name]
        shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
        return dequantize(self.index.raw(name), t.qtype, shape, name=name)

    def get_raw(self, name: str) -> RawWeight:
        """A 2-D tensor in its encoding when the matmul reads it (a view of the memory map), else as F32."""
        t = self.index.tensors[name]
        k, n = t.shape  # GGUF order: innermost (K) first; 2-D (the checkpoint check)
        if native_ok(t.qtype, n, k):
            with warnings.catch_warnings():  # a read-only map: the kernels only read it
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                data = torch.from_numpy(self.index.raw(name))
            return RawWeight.from_bytes(t.qtype, n, k, data)
        return RawWeight.from_tensor(self.get(name))

    def get_raw_experts(self, name: str) -> list[RawWeight]:
        """A 3-D tensor of routed experts (GGUF ``[K, N, E]``, innermost first) as one ``[N, K]`` weight per expert:
        views of the memory map where the matmul reads the type, else each expert dequantized to F32."""
        t = self.index.tensors[name]
        k, n, e = t.shape  # 3-D (the checkpoint check)
        if native_ok(t.qtype, n, k):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                data = torch.from_numpy(self.index.raw(name)).reshape(e, -1)
            return [RawWeight.from_bytes(t.qtype, n, k, data[i]) for i in range(e)]
        full = self.get(name)  # [E, N, K] fp32
        return [RawWeight.from_tensor(full[i]) for i in range(e)]


class HFSource:
    """Tensors of an HF directory's ``*.safetensors`` shards (its ``HFIndex``), opened lazily by name."""

    def __init__(self, path: Path, index: HFIndex) -> None:
        self.path, self.index = path, index
        self.file_of: dict[str, Path] = {name: t.file for name, t in index.tensors.items()}

    def has(self, name: str) -> bool:
        return name in self.file_of

    def names_under(self, prefix: str) -> list[str]:
        return [n for n in self.file_of if n.startswith(prefix)]

    def type_name(self, name: str) -> str:
        return self.index.tensors[name].dtype

    def stored_bytes(self, name: str) -> int:
        t = self.index.tensors[name]
        n = 1
        for d in t.shape:
            n *= d
        return n * {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(t.dtype, 1)

    def held_bytes(self, name: str, native: bool, width: float) -> tuple[int, bool]:
        """As ``GGUFSource.held_bytes``: F32 / F16 / BF16 weights stay as stored on native stages."""
        shape, dtype = self.index.tensors[name].shape, self.index.tensors[name].dtype
        n_el = 1
        for d in shape:
            n_el *= d
        stored = {"F32": 4, "F16": 2, "BF16": 2}.get(dtype)
        if native and stored is not None:
            return n_el * stored, False
        if dtype == "U8" and name.endswith(HF_MXFP4_SUFFIXES):  # gpt-oss's MXFP4 experts: packed as stored, or
            expanded = 0 if name.endswith("_scales") else int(2 * n_el * width)  # 2 weights a block byte
            return (n_el, False) if native else (expanded, True)
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
