"""GGUF tensor bytes → a float32 torch tensor: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 here, the rest by gguf.

Block layouts (ggml ``ggml-common.h``; QK = 32 weights per block, blocks run along the innermost dim):

    Q8_0  34 B: d f16 | qs int8[32]                     w[j]      = d * qs[j]
    Q4_0  18 B: d f16 | qs u8[16]                       w[j]      = d * ((qs[j] & 0xF) - 8)
                                                        w[j + 16] = d * ((qs[j] >> 4) - 8)
    Q4_1  20 B: d f16 | m f16 | qs u8[16]               w[j]      = d * (qs[j] & 0xF) + m
                                                        w[j + 16] = d * (qs[j] >> 4) + m

Q8_0, Q4_0 and Q4_1 run in C (csrc/dequant.c): numpy took 3.7 s for SmolLM2's Q8_0 embedding alone on a
loaded core, which every stage process paid at startup.
Other types that ``gguf.quants.dequantize`` implements (K-quants, Q5_*, IQ*) go through it.
Arithmetic follows gguf.quants (f16 scales widened to f32, ``d * q (+ m)`` in f32), so results match it bitwise.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm._C import ffi, lib
from ringshm.errors import UnsupportedQuantType


def _c_blocks(data: np.ndarray, qtype: QT, name: str) -> torch.Tensor:
    """Q8_0 / Q4_0 / Q4_1 through the C loops in csrc/dequant.c: flat float32 ``[32 * n_blocks]``."""
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    block_bytes, fn = _C_QUANT[qtype]
    if raw.size % block_bytes:
        raise ValueError(f"tensor {name!r}: {raw.size} bytes is not a whole number of {qtype.name} blocks")
    n_blocks = raw.size // block_bytes
    out = torch.empty(n_blocks * QK, dtype=torch.float32)
    fn(ffi.from_buffer("uint8_t[]", raw), ffi.cast("float *", out.data_ptr()), n_blocks)
    return out


QK = 32  # weights per block
_C_QUANT = {QT.Q8_0: (34, lib.ringshm_dequant_q8_0), QT.Q4_0: (18, lib.ringshm_dequant_q4_0),
            QT.Q4_1: (20, lib.ringshm_dequant_q4_1)}
_TORCH_FLOAT = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


def dequantize(data: np.ndarray, qtype: QT | int, shape: tuple[int, ...], name: str = "?") -> torch.Tensor:
    """Dequantize one GGUF tensor's data to float32 of ``shape`` (torch order, outermost dim first).

    ``data``: the tensor's bytes, e.g. ``GGUFIndex.raw(name)`` (flat ``uint8``), or what ``gguf.GGUFReader``
    gives (float arrays for F32/F16, ``uint8 [rows, bytes_per_row]`` for quantized types). The result is a
    new, writable tensor.

    Raises:
        UnsupportedQuantType: neither this module nor ``gguf.quants`` can dequantize ``qtype``.
        ValueError: the bytes are not a whole number of blocks.
    """
    qtype = QT(qtype)
    if qtype in _TORCH_FLOAT:
        flat = torch.from_numpy(np.array(data, copy=True).reshape(-1).view(np.uint8))
        return flat.view(_TORCH_FLOAT[qtype]).float().reshape(shape)
    if qtype in _C_QUANT:
        return _c_blocks(data, qtype, name).reshape(shape)
    try:
        out = quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError as exc:
        raise UnsupportedQuantType(f"tensor {name!r}: GGUF quantization type {qtype.name} is not supported "
                                   f"(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1 and what gguf.quants "
                                   f"dequantizes)") from exc
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
