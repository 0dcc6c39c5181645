"""GGUF tensor bytes → a float32 torch tensor: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 here, the rest by gguf.

Block layouts (ggml ``ggml-common.h``; QK = 32 weights per block, blocks run along the innermost dim):

    Q8_0  34 B: d f16 | qs int8[32]                     w[j]      = d * qs[j]
    Q4_0  18 B: d f16 | qs u8[16]                       w[j]      = d * ((qs[j] & 0xF) - 8)
                                                        w[j + 16] = d * ((qs[j] >> 4) - 8)
    Q4_1  20 B: d f16 | m f16 | qs u8[16]               w[j]      = d * (qs[j] & 0xF) + m
                                                        w[j + 16] = d * (qs[j] >> 4) + m

Vectorized numpy over whole tensors (torch's uint8 shifts and casts measured ~10x slower on CPU here).
Other types that ``gguf.quants.dequantize`` implements (K-quants, Q5_*, IQ*) go through it.
Arithmetic follows gguf.quants (f16 scales widened to f32, ``d * q (+ m)`` in f32), so results match it bitwise.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm.errors import UnsupportedQuantType


def _f16(b: np.ndarray) -> np.ndarray:
    # [n_blocks, 2] bytes -> [n_blocks, 1] f32
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # [n_blocks, 16] u8 -> [n_blocks, 32] f32: low nibbles are weights 0..15, high nibbles 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 34)  # [n_blocks, 34 bytes]
    return _f16(blocks[:, :2]) * np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32)


def _q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 18)
    return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:]) - np.float32(8))


def _q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 20)
    return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]) + _f16(blocks[:, 2:4])


_NUMPY_QUANT = {QT.Q8_0: _q8_0, QT.Q4_0: _q4_0, QT.Q4_1: _q4_1}
_TORCH_FLOAT = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


def dequantize(data: np.ndarray, qtype: QT | int, shape: tuple[int, ...], name: str = "?") -> torch.Tensor:
    """Dequantize one GGUF tensor's data to float32 of ``shape`` (torch order, outermost dim first).

    ``data`` is what ``gguf.GGUFReader`` gives for the tensor: float arrays for F32/F16, raw ``uint8`` bytes
    (``[rows, bytes_per_row]``) for quantized types. The result is a new, writable tensor.

    Raises:
        UnsupportedQuantType: neither this module nor ``gguf.quants`` can dequantize ``qtype``.
    """
    qtype = QT(qtype)
    if qtype in _TORCH_FLOAT:
        flat = torch.from_numpy(np.array(data, copy=True).reshape(-1).view(np.uint8))
        return flat.view(_TORCH_FLOAT[qtype]).float().reshape(shape)
    if qtype in _NUMPY_QUANT:
        out = _NUMPY_QUANT[qtype](np.asarray(data, dtype=np.uint8).reshape(-1))
        return torch.from_numpy(out).reshape(shape)
    try:
        out = quants.dequantize(np.asarray(data), qtype)
    except NotImplementedError as exc:
        raise UnsupportedQuantType(f"tensor {name!r}: GGUF quantization type {qtype.name} is not supported "
                                   f"(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1 and what gguf.quants "
                                   f"dequantizes)") from exc
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(shape)
