"""Quantized GGUF weights for the test zoo: which type each tensor gets, and blocks that dequantize exactly.

Two jobs, both for ``tests/zoo.py``:

1. **Recipes** (``tensor_type``). A recipe names what made the file:

   - ``f32`` / ``f16`` / ``bf16`` / ``q8_0`` are the outtypes of llama.cpp's ``convert_hf_to_gguf.py``: every
     tensor with two or more dims in that type (token embedding and LM head included); 1-D tensors and any
     name ending ``_norm.weight`` always F32 (the converter's ``prepare_tensors`` forces them).
   - ``q4_0`` … ``q6_k`` (one ggml type name) are ``llama-quantize --pure``: every 2-D weight in that type.
   - ``q4_k_m`` is ``llama-quantize`` Q4_K_M (``llama_tensor_get_type`` in ``src/llama-quant.cpp``): base type
     Q4_K; ``attn_v`` (and a fused ``attn_qkv``, which counts as attn_v-like) and ``ffn_down`` in Q6_K on the
     layers ``use_more_bits`` picks (``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``, integer division: for 4
     layers that is 2 and 3, for 6 layers 2 and 5, for Gemma 3 270M's 18 layers 0, 1, 4, 7, 10, 13, 15, 16, 17);
     the LM head, or the token embedding when the model ties them (no ``output.weight``), in Q6_K, or Q8_0
     when its row width is not a multiple of 256. Routed experts follow the dense roles (``ffn_down_exps`` as
     ``ffn_down``); the MoE router ``ffn_gate_inp`` stays F32 in every recipe (the converter and llama-quantize
     never quantize it).
   - In every quantized recipe (``--pure`` too) a K-quant whose row width (ggml ``ne[0]``, the input dim) is not
     a multiple of 256 falls back as llama-quantize's ``tensor_type_fallback`` does: Q4_K → Q5_0, Q5_K → Q5_1,
     Q6_K → Q8_0, Q2_K / Q3_K → Q4_0 (F16 if even that does not fit).
     The real Gemma 3 270M Q4_K_M file (hidden 640) shows exactly this: Q5_0 where Q4_K was meant, Q8_0 where
     Q6_K was meant.

2. **Blocks** (``make_weight``). gguf-py quantizes F16 / BF16 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 but has only
   dequantizers for the K-quants and IQ4_NL. Types with a quantizer get a Gaussian ``N(0, std)`` quantized by
   ``gguf.quants.quantize``; the others get random bytes with their fp16 scale fields (``d``, and ``dmin`` where
   the type has one) written by hand: per block, ``dmin / d`` is chosen so the block's mean is about 0 and ``d``
   so its standard deviation is about ``std``.

Exactness. Every value a block decodes to is ``d * (small int) [- dmin * (small int)]`` (Q4_1 / Q5_1 add the
fp16 min ``m``). Here ``d`` and ``dmin`` (or ``m``) are integer multiples of one power of two ``2^-E`` with at
most 11 significant bits, so every product and sum is an integer multiple of ``2^-E`` below ``2^24`` of them:
exact in fp32 whatever the order of operations (fused multiply-add or not, one accumulator or several). Any
correct dequantizer — gguf-py's numpy, ggml's C, ringshm's — gives the same fp32 bits, and the HF copy of the
weight is those bits.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from gguf import quants as gq

Q = GGMLQuantizationType

# Recipe → (GGUF general.file_type, the type most 2-D weights get)
RECIPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "f32": (LlamaFileType.ALL_F32, Q.F32),
    "f16": (LlamaFileType.MOSTLY_F16, Q.F16),
    "bf16": (LlamaFileType.MOSTLY_BF16, Q.BF16),
    "q8_0": (LlamaFileType.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (LlamaFileType.MOSTLY_Q4_0, Q.Q4_0),
    "q4_1": (LlamaFileType.MOSTLY_Q4_1, Q.Q4_1),
    "q5_0": (LlamaFileType.MOSTLY_Q5_0, Q.Q5_0),
    "q5_1": (LlamaFileType.MOSTLY_Q5_1, Q.Q5_1),
    "q2_k": (LlamaFileType.MOSTLY_Q2_K, Q.Q2_K),
    "q3_k": (LlamaFileType.MOSTLY_Q3_K_S, Q.Q3_K),
    "q4_k": (LlamaFileType.MOSTLY_Q4_K_S, Q.Q4_K),
    "q5_k": (LlamaFileType.MOSTLY_Q5_K_S, Q.Q5_K),
    "q6_k": (LlamaFileType.MOSTLY_Q6_K, Q.Q6_K),
    "q4_k_m": (LlamaFileType.MOSTLY_Q4_K_M, Q.Q4_K),
}

# llama-quantize's fallback for a K-quant on a row width that is not a multiple of 256
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0}

# Byte offsets of the fp16 scale fields in one block: (d, dmin or None). Layouts as ggml-common.h's block_* structs
# (and gguf-py's dequantizers): Q2_K = scales[16] qs[64] d dmin; Q3_K = hmask[32] qs[64] scales[12] d;
# Q4_K = d dmin scales[12] qs[128]; Q5_K = d dmin scales[12] qh[32] qs[128]; Q6_K = ql[128] qh[64] scales[16] d;
# IQ4_NL = d qs[16].
_SCALE_FIELDS: dict[GGMLQuantizationType, tuple[int, int | None]] = {
    Q.Q2_K: (80, 82), Q.Q3_K: (108, None), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, None), Q.IQ4_NL: (0, None),
}
for _t in _SCALE_FIELDS:  # the block sizes these offsets assume
    assert GGML_QUANT_SIZES[_t][1] == {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210,
                                       Q.IQ4_NL: 18}[_t]
_QUANTIZABLE = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4)
_WITH_MIN = (Q.Q4_1, Q.Q5_1)  # block = fp16 d, fp16 m, quants; value = d * q + m


def recipe_file_type(recipe: str) -> LlamaFileType:
    """The ``general.file_type`` a file made by ``recipe`` carries.

    Raises:
        KeyError: unknown recipe (``RECIPES`` lists them).
    """
    return RECIPES[recipe][0]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of layers that get more bits (its ``use_more_bits``, integer division)."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(recipe: str, role: str, layer: int | None, n_layers: int, row_width: int, n_dims: int,
                tied: bool) -> GGMLQuantizationType:
    """The ggml type of one tensor of a file made by ``recipe`` (module docstring; llama-quantize's
    ``llama_tensor_get_type`` for the quantized recipes, where a fused ``attn_qkv`` counts as attn_v-like).

    ``role`` is the GGUF name without ``blk.{i}.`` and ``.weight`` / ``.bias`` (``token_embd``, ``attn_v``,
    ``attn_q_norm``, ``rope_freqs``, …), with ``.bias`` kept for biases; ``row_width`` is ggml's ``ne[0]``
    (the input dim of a linear weight, the hidden size of the embedding); ``tied``: the file has no
    ``output.weight``, so ``token_embd`` is also the LM head.
    """
    base = RECIPES[recipe][1]
    # the MoE router and the shared expert's gate (a [1, hidden] row: ggml_n_dims 1) are never quantized
    if n_dims < 2 or role.endswith(("_norm", ".bias")) or role in ("ffn_gate_inp", "ffn_gate_inp_shexp"):
        return Q.F32
    if recipe in ("f32", "f16", "bf16", "q8_0"):
        return base
    qtype = base
    if recipe == "q4_k_m":
        is_head = role == "output" or (tied and role == "token_embd")
        if is_head:
            return Q.Q8_0 if row_width % 256 else Q.Q6_K
        if role in ("attn_v", "attn_qkv", "ffn_down", "ffn_down_exps", "ffn_down_shexp") and use_more_bits(
                layer, n_layers):
            qtype = Q.Q6_K
    if row_width % GGML_QUANT_SIZES[qtype][0]:
        qtype = _FALLBACK.get(qtype, qtype)
        if row_width % GGML_QUANT_SIZES[qtype][0]:
            qtype = Q.F16
    return qtype


def make_weight(qtype: GGMLQuantizationType, shape: tuple[int, ...], std: float,
                rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random weight of ``shape`` ``[rows, cols]`` (or ``[n]``) encoded as ``qtype``, and its exact fp32 decode.

    Returns ``(raw, values)``: ``raw`` is what ``GGUFWriter.add_tensor(..., raw_dtype=qtype)`` takes (fp32 /
    fp16 elements, or uint8 ``[rows, cols / block * block_bytes]``), ``values`` fp32 ``shape``, equal bit for bit
    to ``gguf.quants.dequantize(raw, qtype)`` and exact (module docstring). Magnitudes: std about ``std``.

    Raises:
        ValueError: ``cols`` not a multiple of the type's block size.
    """
    if qtype in _QUANTIZABLE:
        x = rng.normal(0.0, std, size=shape).astype(np.float32)
        if qtype == Q.F32:
            return x, x
        raw = gq.quantize(x, qtype)
        if qtype in _WITH_MIN:
            raw = _snap_min(raw, qtype)
    else:
        raw = _random_blocks(qtype, shape, std, rng)
    return raw, np.ascontiguousarray(gq.dequantize(raw, qtype), dtype=np.float32).reshape(shape)


def dequantize_f64(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """An independent fp64 decode of ``raw``: ``d * A + s * B`` per block, where ``A`` / ``B`` are the block
    decoded with its fp16 scale fields set to (1, 0) / (0, 1) (small integers, exact) and ``(d, s)`` the real
    fields. Equal to gguf-py's fp32 decode exactly when every value is exact in fp32. Shape: as
    ``gguf.quants.dequantize``; float and F16 / BF16 tensors decode as themselves.
    """
    fields = {**_SCALE_FIELDS, Q.Q4_0: (0, None), Q.Q5_0: (0, None), Q.Q8_0: (0, None), Q.Q4_1: (0, 2),
              Q.Q5_1: (0, 2)}
    if qtype not in fields:
        return gq.dequantize(raw, qtype).astype(np.float64)
    d_off, s_off = fields[qtype]
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])

    def field(off: int) -> np.ndarray:
        return blocks[:, off:off + 2].copy().view(np.float16).astype(np.float64)  # [n_blocks, 1]

    def decode(d: float, s: float) -> np.ndarray:
        b = blocks.copy()
        b[:, d_off:d_off + 2] = np.array([d], np.float16).view(np.uint8)
        if s_off is not None:
            b[:, s_off:s_off + 2] = np.array([s], np.float16).view(np.uint8)
        return gq.dequantize(b, qtype).astype(np.float64)

    value = field(d_off) * decode(1.0, 0.0)
    if s_off is not None:
        value = value + field(s_off) * decode(0.0, 1.0)
    rows = raw.shape[0] if raw.ndim > 1 else 1
    return value.reshape(rows, -1) if raw.ndim > 1 else value.reshape(-1)


def _snap_min(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Round each block's fp16 min ``m`` to a multiple of the ulp of its ``d`` (so ``d * q + m`` is exact)."""
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, block_bytes).copy()
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)[:, 0]
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)[:, 0]
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(d), 2.0 ** -24))) - 10)
    snapped = (np.round(m / ulp) * ulp).astype(np.float16)
    assert np.all(snapped.astype(np.float64) == np.round(m / ulp) * ulp), "snapped min not representable"
    blocks[:, 2:4] = snapped.reshape(-1, 1).view(np.uint8)
    return blocks.reshape(raw.shape)


def _random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], std: float,
                   rng: np.random.Generator) -> np.ndarray:
    """Random quant bytes with hand-set fp16 scales (K-quants, IQ4_NL): mean about 0, std about ``std``."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    if cols % block:
        raise ValueError(f"{qtype.name}: row width {cols} is not a multiple of {block}")
    n_blocks = rows * cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    d_off, m_off = _SCALE_FIELDS[qtype]

    def with_scales(d: np.ndarray, dmin: np.ndarray | None) -> np.ndarray:
        b = blocks.copy()
        b[:, d_off:d_off + 2] = d.astype(np.float16).reshape(-1, 1).view(np.uint8)
        if m_off is not None:
            b[:, m_off:m_off + 2] = dmin.astype(np.float16).reshape(-1, 1).view(np.uint8)
        return b

    ones, zeros = np.ones(n_blocks), np.zeros(n_blocks)
    a = gq.dequantize(with_scales(ones, zeros), qtype).astype(np.float64)  # value per unit d, [n_blocks, block]
    if m_off is not None:
        b = gq.dequantize(with_scales(zeros, ones), qtype).astype(np.float64)  # value per unit dmin (<= 0)
        ratio = -a.mean(axis=1) / np.minimum(b.mean(axis=1), -1e-9)  # dmin / d that centres the block
    else:
        b, ratio = np.zeros_like(a), zeros
    unit_std = np.maximum((a + ratio[:, None] * b).std(axis=1), 1e-9)
    d = std / unit_std * rng.uniform(0.7, 1.3, size=n_blocks)  # per-block spread, as real blocks have
    dmin = ratio * d
    # one grid 2^-E per block: both scales integers <= 2047 times 2^-E (11 bits: exact in fp16; E <= 24 keeps
    # them on fp16's grid, subnormals included)
    top = np.maximum(d, np.abs(dmin))
    e = np.minimum(np.floor(np.log2(2047.0 / top)), 24.0)
    assert np.all(top * np.exp2(e) >= 64), "scales too small for fp16; raise std"
    d = np.maximum(np.round(d * np.exp2(e)), 1.0) * np.exp2(-e)
    dmin = np.round(dmin * np.exp2(e)) * np.exp2(-e)
    assert np.all(d.astype(np.float16).astype(np.float64) == d)
    assert np.all(dmin.astype(np.float16).astype(np.float64) == dmin)
    out = with_scales(d, dmin if m_off is not None else None)
    return out.reshape(rows, cols // block * block_bytes) if len(shape) == 2 else out.reshape(-1)
