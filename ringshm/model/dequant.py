"""GGUF tensor bytes → a float32 torch tensor: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and the
K-quants Q4_K, Q5_K, Q6_K here, the rest by gguf.

Block layouts (ggml ``ggml-common.h``, drawn bit by bit in csrc/gguf_blocks.h; blocks run along the innermost
dim; q is the block's integer):

    Q8_0  34 B / 32 w: d f16 | qs int8[32]                       w = d * q
    Q4_0  18 B / 32 w: d f16 | qs u8[16]                         w = d * (q - 8)
    Q4_1  20 B / 32 w: d f16 | m f16 | qs u8[16]                 w = d * q + m
    Q5_0  22 B / 32 w: d f16 | qh u8[4] | qs u8[16]              w = d * (q - 16)
    Q5_1  24 B / 32 w: d f16 | m f16 | qh u8[4] | qs u8[16]      w = d * q + m
    MXFP4 17 B / 32 w: e u8 | qs u8[16]                          w = 2^(e - 128) * kvalues[q]  (E8M0 e, e2m1 x 2)
    Q4_K 144 B / 256 w: d | dmin | scales[12] | qs[128]          w = (d * sc) * q - dmin * m   (6-bit sc, m per 32)
    Q5_K 176 B / 256 w: Q4_K's fields | qh[32] | qs[128]         w = (d * sc) * q - dmin * m
    Q6_K 210 B / 256 w: ql[128] | qh[64] | scales i8[16] | d     w = (d * sc) * (q - 32)      (int8 sc per 16)

These run in C (csrc/dequant.c): numpy took 3.7 s for SmolLM2's Q8_0 embedding alone on a loaded core, which
every stage process paid at startup. Other types that ``gguf.quants.dequantize`` implements (Q2_K, Q3_K, IQ*)
go through it. Arithmetic follows gguf.quants (f16 fields widened to f32, then its float32 operations in its
order, one rounding each), so results match it bitwise.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm._C import ffi, lib
from ringshm.errors import UnsupportedQuantType


def _c_blocks(data: np.ndarray, qtype: QT, name: str) -> torch.Tensor:
    """A quantized type through its C loop in csrc/dequant.c: flat float32 ``[weights_per_block * n_blocks]``."""
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    block_bytes, block_weights, fn = _C_QUANT[qtype]
    if raw.size % block_bytes:
        raise ValueError(f"tensor {name!r}: {raw.size} bytes is not a whole number of {qtype.name} blocks")
    n_blocks = raw.size // block_bytes
    out = torch.empty(n_blocks * block_weights, dtype=torch.float32)
    fn(ffi.from_buffer("uint8_t[]", raw), ffi.cast("float *", out.data_ptr()), n_blocks)
    return out


QK, QK_K = 32, 256  # weights per block, per K-quant super-block
_C_QUANT = {  # type: (bytes per block, weights per block, C loop)
    QT.Q8_0: (34, QK, lib.ringshm_dequant_q8_0), QT.Q4_0: (18, QK, lib.ringshm_dequant_q4_0),
    QT.Q4_1: (20, QK, lib.ringshm_dequant_q4_1), QT.Q5_0: (22, QK, lib.ringshm_dequant_q5_0),
    QT.Q5_1: (24, QK, lib.ringshm_dequant_q5_1), QT.Q4_K: (144, QK_K, lib.ringshm_dequant_q4_k),
    QT.Q5_K: (176, QK_K, lib.ringshm_dequant_q5_k), QT.Q6_K: (210, QK_K, lib.ringshm_dequant_q6_k),
    QT.MXFP4: (17, QK, lib.ringshm_dequant_mxfp4)}
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
                                   f"(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, "
                                   f"Q5_K, Q6_K and what gguf.quants dequantizes)") from exc
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
