"""The transformers oracle from a GGUF file, loaded without its tokenizer arrays.

``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` parses the whole file with ``gguf.GGUFReader`` twice
(once for the config, once for the weights), and that reader builds a numpy view per element of every array: for
Gemma 3 270M (262,144 tokens, scores and token types) that was ~130 s of a 140 s load, for SmolLM2 (49k tokens and
49k merges) ~30 s, the slowest setup of the suite. The oracle needs none of it (the tokenizer is built elsewhere), so
it loads a copy of the file whose ``tokenizer.ggml.*`` arrays are left out, byte for byte otherwise: the other
metadata entries and the tensor table are copied as they are, the tensor data as it is after the new header's
alignment padding (tensor offsets are relative to the data's start, so they stay valid), and
``<arch>.vocab_size`` is added where the file did not carry it (transformers takes it from the token list
otherwise). The weights transformers reads, and so the oracle, are those of the original file.

Its mapping of tensor names cost SmolLM2 another ~18 s: transformers' ``get_gguf_hf_weights_map`` walks the model's
modules and calls ``gguf.get_tensor_name_map(arch, n_layers)`` for each (397 times for SmolLM2), and that builds
the same read-only ``TensorNameMap`` every time; ``same_name_maps`` builds it once per (arch, n_layers).
"""

from __future__ import annotations

import functools
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> size
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> bytes:
        n = self.take("<Q")
        self.at += n
        return self.data[self.at - n:self.at]

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                for _ in range(count):
                    n = self.take("<Q")
                    self.at += n
            else:
                self.at += _SCALAR_BYTES[etype] * count
        else:
            self.at += _SCALAR_BYTES[vtype]


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def slim_copy(src: Path, dst: Path, vocab_size: int) -> Path:
    """Write ``dst``: ``src`` without its ``tokenizer.ggml.*`` arrays (see the module's docstring)."""
    with open(src, "rb") as f:
        head = f.read(64 << 20)  # the header lies well inside (Gemma 3's: ~6 MiB)
    c = _Cursor(head)
    assert head[:4] == b"GGUF"
    c.at = 4
    version, n_tensors, n_kv = c.take("<I"), c.take("<Q"), c.take("<Q")
    kept, alignment, arch = [], 32, None
    for _ in range(n_kv):
        start = c.at
        key = c.string().decode()
        vtype = c.take("<I")
        value_at = c.at
        c.skip_value(vtype)
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", head, value_at)[0]
        if key == "general.architecture":
            arch = _Cursor(head[value_at:c.at]).string().decode()
        if not (key.startswith("tokenizer.ggml.") and vtype == _ARRAY):
            kept.append((key, head[start:c.at]))
    table_start = c.at
    for _ in range(n_tensors):
        c.string()
        n_dims = c.take("<I")
        c.at += 8 * n_dims + 4 + 8
    table = head[table_start:c.at]
    data_start = -(-c.at // alignment) * alignment
    entries = [raw for _, raw in kept]
    if f"{arch}.vocab_size" not in {key for key, _ in kept}:
        entries.append(_kv(f"{arch}.vocab_size", _UINT32, struct.pack("<I", vocab_size)))
    header = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(entries)) + b"".join(entries) + table
    header += b"\0" * (-len(header) % alignment)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(header)
        fin.seek(data_start)
        shutil.copyfileobj(fin, fout, 16 << 20)
    return dst


@contextmanager
def same_name_maps():
    """Within: ``gguf.get_tensor_name_map`` returns one map per (arch, n_layers) (see the module's docstring)."""
    import gguf

    with mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


def load_oracle(gguf_path: Path, tmp_dir: Path, vocab_size: int):
    """transformers' model for ``gguf_path`` in fp32, eval mode, loaded from its slim copy in ``tmp_dir``."""
    from transformers import AutoModelForCausalLM

    slim = slim_copy(Path(gguf_path), Path(tmp_dir) / Path(gguf_path).name, vocab_size)
    with same_name_maps():
        return AutoModelForCausalLM.from_pretrained(str(slim.parent), gguf_file=slim.name,
                                                    dtype=torch.float32).eval()
