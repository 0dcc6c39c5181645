"""Weights in their checkpoint encoding and the batch-invariant matmul over them (csrc/matmul.h).

``RawWeight`` is a ``[N, K]`` weight as the checkpoint stores it: GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks,
the K-quants Q4_K / Q5_K / Q6_K, MXFP4 (gpt-oss's experts), F16, BF16 or F32, one row of bytes per output row (for
a GGUF file, a view of its memory map: no copy). ``PackedWeight`` is
the same weight rearranged once at load into 16-row panels for ``ringshm_qmat_matmul``, which computes
``out = x · Wᵀ (+ bias) (+ residual)`` in fp32 with every output element reduced in one fixed order, whatever
the number of rows in ``x`` and the thread count (batch invariance; the order is drawn in csrc/matmul.h).
Activations stay fp32 (weight-only quantization), so the product equals the fp32-dequantized one up to
rounding order; the opt-in ``activations="int8"`` quantizes each row of x per block of 32 instead
(``ringshm_qmat_matmul_q8``, ``quantize_rows``: matmul.h's 8-bit contract, batch-invariant too).

The instruction set is chosen once per process from the CPU (``BEST_ISA``: AVX-512, AVX2 + FMA, or portable
C); every path gives the same bits, so a test can run the portable one beside the fast one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ringshm._C import ffi, lib
from ringshm.config import MATMUL_ACTIVATIONS
from ringshm.errors import check_status
from ringshm.model.hugepages import weight_buffer

QK = 32  # weights per legacy quantized block (ggml's QK4_0 / QK5_0 / QK8_0 ...)
QK_K = 256  # weights per K-quant super-block (ggml's QK_K)

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = (lib.RINGSHM_W_F32, lib.RINGSHM_W_F16, lib.RINGSHM_W_Q4_0, lib.RINGSHM_W_Q4_1,
                                    lib.RINGSHM_W_Q8_0, lib.RINGSHM_W_BF16)
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = (lib.RINGSHM_W_Q5_0, lib.RINGSHM_W_Q5_1, lib.RINGSHM_W_Q4_K, lib.RINGSHM_W_Q5_K,
                                lib.RINGSHM_W_Q6_K)
MXFP4 = lib.RINGSHM_W_MXFP4
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", BF16: "BF16", MXFP4: "MXFP4"}
"""The encodings the kernel reads natively, by ggml type code (``gguf.GGMLQuantizationType``)."""
K_QUANTS = (Q4_K, Q5_K, Q6_K)
QUANTIZED = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, *K_QUANTS)
WITH_MIN = (Q4_1, Q5_1, Q4_K, Q5_K)
"""Types whose reduction adds a min term per block of 32 (their block sums of x limit K to 65536)."""


def block_k(qtype: int) -> int:
    """Weights per block along K: 256 for the K-quants, 32 for the other quantized types, 1 for floats."""
    return QK_K if qtype in K_QUANTS else QK if qtype in QUANTIZED else 1
_TORCH_TYPE = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
_TYPE_TORCH = {v: k for k, v in _TORCH_TYPE.items()}

ISA_NAMES = {lib.RINGSHM_ISA_PORTABLE: "portable", lib.RINGSHM_ISA_AVX2: "avx2", lib.RINGSHM_ISA_AVX512: "avx512"}
BEST_ISA: int = lib.ringshm_isa_best()
"""The path this CPU runs (cpuid): ``lib.RINGSHM_ISA_AVX512``, ``_AVX2`` or ``_PORTABLE``."""

def type_name(qtype: int) -> str:
    return TYPE_NAMES.get(qtype, f"ggml type {qtype}")


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` weights in the checkpoint's encoding (ggml's block sizes: Q4_K 144 B per 256
    weights, Q6_K 210 B, Q5_0 22 B per 32, MXFP4 17 B, ...).

    Raises:
        ValueError: unknown type, ``k <= 0``, ``k`` not a multiple of the type's block (32; 256 for the
            K-quants), or ``k > 65536`` for a type with a min.
    """
    if qtype not in TYPE_NAMES:
        names = ", ".join(TYPE_NAMES[t] for t in sorted(TYPE_NAMES))
        raise ValueError(f"weight type {type_name(qtype)} is not one the matmul reads ({names}); dequantize it "
                         f"to F32 first")
    n = lib.ringshm_qmat_src_bytes(qtype, 1, k)
    if n < 0:
        bk = block_k(qtype)
        why = ("K must be in [1, 2^31 - 1)" if not 0 < k < 2**31 - 1
               else f"K must be a multiple of {bk} (the {'super-' if bk == QK_K else ''}block size)" if k % bk
               else f"{type_name(qtype)} takes K <= 65536 (its block sums of x live on the stack); dequantize it "
                    f"to F32")
        raise ValueError(f"a {type_name(qtype)} row of K = {k} weights: {why}")
    return int(n)


def native_ok(qtype: int, n: int, k: int) -> bool:
    """Whether the matmul reads an ``[n, k]`` weight of ``qtype`` as it is (else dequantize it to F32): a type in
    ``TYPE_NAMES`` and ``k`` whole blocks (a K-quant: ``k % 256 == 0``; ggml itself falls back to Q5_0 / Q8_0
    for rows that are not), at most 65536 for a type with a min."""
    return qtype in TYPE_NAMES and lib.ringshm_qmat_src_bytes(qtype, n, k) > 0


@dataclass(frozen=True)
class RawWeight:
    """A ``[n, k]`` weight in its checkpoint encoding: ``data`` is uint8 ``[n, row_bytes(qtype, k)]`` on the CPU.

    Row ``i`` of ``data`` is output row ``i`` (GGUF and safetensors both store a linear layer's rows
    contiguously), so rows can be reordered and concatenated in the encoded domain.
    """

    qtype: int
    n: int
    k: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        want = (self.n, row_bytes(self.qtype, self.k))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or self.data.device.type != "cpu":
            raise ValueError(f"RawWeight {type_name(self.qtype)} [{self.n}, {self.k}] needs uint8 CPU bytes of "
                             f"shape {want}, got {self.data.dtype} {tuple(self.data.shape)} on {self.data.device}")

    @classmethod
    def from_tensor(cls, w: torch.Tensor) -> RawWeight:
        """Wrap a float ``[n, k]`` tensor (fp32, fp16 or bf16) without converting it (a contiguous copy at most)."""
        if w.dim() != 2 or w.dtype not in _TORCH_TYPE:
            raise ValueError(f"RawWeight.from_tensor takes a 2-D fp32/fp16/bf16 tensor, got {w.dtype} "
                             f"{tuple(w.shape)}")
        w = w.detach().to("cpu").contiguous()
        return cls(_TORCH_TYPE[w.dtype], w.shape[0], w.shape[1], w.view(torch.uint8).reshape(w.shape[0], -1))

    @classmethod
    def from_bytes(cls, qtype: int, n: int, k: int, raw: np.ndarray | torch.Tensor) -> RawWeight:
        """A GGUF tensor's bytes (flat uint8, e.g. ``GGUFIndex.raw(name)``; a read-only memmap is not copied).

        Raises:
            ValueError: the byte count is not ``n`` rows of ``k`` weights of ``qtype``.
        """
        t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.asarray(raw, dtype=np.uint8))
        rb = row_bytes(qtype, k)
        if t.numel() != n * rb:
            raise ValueError(f"{type_name(qtype)} [{n}, {k}] takes {n * rb} bytes, got {t.numel()}")
        return cls(qtype, n, k, t.reshape(n, rb))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 ``[n, k]`` (exact: quantized blocks as gguf.quants computes them, floats widened)."""
        if self.qtype in _TYPE_TORCH:
            return self.data.contiguous().view(_TYPE_TORCH[self.qtype]).reshape(self.n, self.k).float()
        ids = torch.arange(self.n, dtype=torch.int64)
        return embed_rows(self, ids)

    def rows(self, order: torch.Tensor) -> RawWeight:
        """Rows picked (or reordered) by the int64 index ``order``: a new RawWeight, a view of these bytes where
        ``order`` is a run of consecutive rows (a fused tensor's part), else a copy."""
        n, first = int(order.numel()), int(order[0]) if order.numel() else 0
        if (n and 0 <= first and first + n <= self.n
                and bool((order == torch.arange(first, first + n, dtype=order.dtype)).all())):
            return RawWeight(self.qtype, n, self.k, self.data[first:first + n])
        return RawWeight(self.qtype, n, self.k, self.data[order].contiguous())  # indexing's rules (and errors)

    def to_f32(self) -> RawWeight:
        """The same weight as F32 bytes (for fusing rows of different encodings)."""
        return RawWeight.from_tensor(self.dequantize())


# Per quantized type: (bytes a block, byte offsets of its fp16 scale fields d / m / dmin): csrc/gguf_blocks.h.
_SCALE_FIELDS = {Q4_0: (18, (0,)), Q4_1: (20, (0, 2)), Q5_0: (22, (0,)), Q5_1: (24, (0, 2)), Q8_0: (34, (0,)),
                 Q4_K: (144, (0, 2)), Q5_K: (176, (0, 2)), Q6_K: (210, (208,))}
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
"""MXFP4's weight of each nibble before its scale 2^(e - 128): e2m1 doubled (ggml's kvalues_mxfp4; 8 is +0)."""


def _mxfp4_overflowing_blocks(data: np.ndarray) -> int:
    """MXFP4 blocks (17 B: E8M0 byte e | 16 B of nibbles) holding a weight that dequantizes to +-inf. ggml reads
    every e as a finite 2^(e - 128) (e = 255 is 2^127, not NaN), but w = 2^(e - 128) * kvalues[q] overflows fp32
    where |kvalues[q]| >= 2^(256 - e): only for e >= 253 (8 x 2^125 = 2^128; at e = 252, 12 x 2^124 is finite),
    so the nibbles of those blocks alone are read."""
    blocks = data.reshape(-1, 17)  # [n_blocks, 17]
    big = np.flatnonzero(blocks[:, 0] >= 253)  # [n_big]
    if not big.size:
        return 0
    qs = blocks[big, 1:]  # [n_big, 16]
    largest = np.maximum(qs & 7, (qs >> 4) & 7).max(axis=1)  # nibble bits 0-2: |kvalue|'s index (bit 3: sign)
    magnitude = np.array(MXFP4_KVALUES[:8], dtype=np.int64)[largest]  # [n_big]
    return int((magnitude >= 1 << (256 - blocks[big, 0].astype(np.int64))).sum())


def count_nonfinite(w: RawWeight | torch.Tensor) -> tuple[int, str]:
    """How much of a weight is NaN or Inf, and in what unit: ``(values, "values")`` for a float tensor or a
    float-encoded RawWeight, ``(blocks, "blocks")`` for a quantized one, counting the blocks with a NaN / Inf
    scale (the integers of a block are finite; a non-finite scale makes its every weight so), and for MXFP4 (whose
    E8M0 scale is always finite) the blocks with a weight that overflows (``_mxfp4_overflowing_blocks``). One pass
    over the floats, or over the scale fields only (2 bytes of every 18-210; MXFP4: 1 of 17, and the nibbles of
    the blocks with e >= 253)."""
    if isinstance(w, torch.Tensor):
        return int((~torch.isfinite(w)).sum()), "values"
    if w.qtype in _TYPE_TORCH:
        return int((~torch.isfinite(w.data.contiguous().view(_TYPE_TORCH[w.qtype]))).sum()), "values"
    data = w.data.contiguous().numpy()  # the file's bytes (a view of its map: nothing copied)
    if w.qtype == MXFP4:
        return _mxfp4_overflowing_blocks(data), "blocks"
    block_bytes, fields = _SCALE_FIELDS[w.qtype]
    n_blocks = data.size // block_bytes
    bad = np.zeros(n_blocks, dtype=bool)
    for at in fields:  # each scale field of every block, as a strided fp16 view: [n_blocks]
        scale = np.ndarray((n_blocks,), dtype="<f2", buffer=data, offset=at, strides=(block_bytes,))
        bad |= ~np.isfinite(scale)
    return int(bad.sum()), "blocks"


def concat_rows(parts: Sequence[RawWeight]) -> RawWeight:
    """Stack weights of the same K along the output rows, in their encoding when they share one (blocks are
    per row); in F32 when they differ.

    Raises:
        ValueError: the parts' K differ.
    """
    ks = {p.k for p in parts}
    if len(ks) != 1:
        raise ValueError(f"concat_rows: the parts have different K {sorted(ks)}")
    if len({p.qtype for p in parts}) != 1:
        parts = [p.to_f32() for p in parts]
    return RawWeight(parts[0].qtype, sum(p.n for p in parts), parts[0].k, torch.cat([p.data for p in parts]))


def embed_rows(w: RawWeight, ids: torch.Tensor) -> torch.Tensor:
    """Embedding lookup: rows ``ids`` of ``w`` dequantized to fp32 ``[len(ids), k]`` (csrc/dequant.c, the same
    code as the loader's dequantization: bit-equal to gguf.quants).

    ``ids``: int64 ``[T]`` on the CPU.

    Raises:
        ValueError: an id outside ``[0, n)`` (nothing is written).
    """
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"embed_rows takes int64 ids [T], got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.to("cpu").contiguous()
    out = torch.empty((ids.numel(), w.k), dtype=torch.float32)
    data = w.data if w.data.is_contiguous() else w.data.contiguous()
    status = lib.ringshm_dequant_rows(w.qtype, ffi.cast("uint8_t *", data.data_ptr()), data.numel(), w.n, w.k,
                                      ffi.cast("int64_t *", ids.data_ptr()), ids.numel(),
                                      ffi.cast("float *", out.data_ptr()))
    if status == -3:
        bad = ids[(ids < 0) | (ids >= w.n)]
        raise ValueError(f"token id {int(bad[0])} outside the vocabulary [0, {w.n})")
    if status < 0:
        raise ValueError(f"embed_rows of {type_name(w.qtype)} [{w.n}, {w.k}]: "
                         + ("the bytes do not match the shape" if status == -2 else "bad type or shape"))
    return out


class PackedWeight:
    """A weight ``[n, k]`` packed into 16-row panels for the matmul (csrc/matmul.h draws the layout).

    ``raw``: one RawWeight, or several of one K whose rows are stacked in order (Q | K | V, gate | up), packed from
    where they lie (``ringshm_qmat_pack_rows``): the same bytes as packing ``concat_rows(raw)`` (parts of different
    encodings all widened to F32, as it does), without its copy (loading a Llama-3.1-8B-shape Q4_K_M, gate | up
    alone was 2.1 GB of fresh memory written and dropped).
    Holds ``packed`` (uint8, ``ringshm_qmat_packed_bytes`` long: the checkpoint's size, plus zero rows up to a
    multiple of 16) and ``bias`` (fp32 ``[n]`` or None).

    Raises:
        ValueError: from ``RawWeight``'s checks; no parts, or parts of different K; a bias that is not fp32 ``[n]``.
    """

    def __init__(self, raw: RawWeight | Sequence[RawWeight], bias: torch.Tensor | None = None) -> None:
        parts = [raw] if isinstance(raw, RawWeight) else list(raw)
        if not parts:
            raise ValueError("PackedWeight takes a RawWeight or one or more parts, got none")
        if len({p.k for p in parts}) != 1:
            raise ValueError(f"PackedWeight stacks parts of one K, got {sorted({p.k for p in parts})}")
        if len({p.qtype for p in parts}) > 1:  # as concat_rows: parts of different encodings all in F32
            parts = [p.to_f32() for p in parts]
        self.qtype, self.k, self.n = parts[0].qtype, parts[0].k, sum(p.n for p in parts)
        self.n_padded = (self.n + 15) // 16 * 16
        size = lib.ringshm_qmat_packed_bytes(self.qtype, self.n, self.k)
        check_status(size, "PackedWeight")
        self.packed = weight_buffer(int(size))  # 2 MiB pages where the kernel gives them (hugepages.py)
        dst = ffi.cast("uint8_t *", self.packed.data_ptr())
        if len(parts) == 1:
            src = parts[0].data.contiguous()
            check_status(lib.ringshm_qmat_pack(self.qtype, ffi.cast("uint8_t *", src.data_ptr()), src.numel(),
                                               self.n, self.k, dst, self.packed.numel()), "PackedWeight")
        else:  # each part's rows where they lie: [n] addresses, read while the parts are held here
            datas = [p.data if p.data.stride(-1) == 1 else p.data.contiguous() for p in parts]
            rows = torch.cat([d.data_ptr() + torch.arange(d.shape[0], dtype=torch.int64) * d.stride(0)
                              for d in datas])
            check_status(lib.ringshm_qmat_pack_rows(self.qtype, ffi.cast("const uint8_t *const *", rows.data_ptr()),
                                                    self.n, self.k, dst, self.packed.numel()), "PackedWeight")
        if bias is not None:
            bias = bias.detach().to("cpu", torch.float32).contiguous()
            if tuple(bias.shape) != (self.n,):
                raise ValueError(f"bias of a [{self.n}, {self.k}] weight must be [{self.n}], got "
                                 f"{tuple(bias.shape)}")
        self.bias = bias
        self._ptr = ffi.cast("uint8_t *", self.packed.data_ptr())
        self._bias_ptr = ffi.NULL if bias is None else ffi.cast("float *", bias.data_ptr())

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def __repr__(self) -> str:
        return f"PackedWeight({type_name(self.qtype)}, n={self.n}, k={self.k}, {self.nbytes} bytes)"

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None, threads: int | None = None,
               isa: int | None = None, activations: str = "float32") -> torch.Tensor:
        """``x · Wᵀ (+ bias) (+ residual)``: fp32 ``[M, k]`` → fp32 ``[M, n]`` (a new tensor).

        ``residual``: fp32 ``[M, n]``, added last (the decoder's skip connection). ``threads``: how many threads
        split the output rows (default ``torch.get_num_threads()``, the stage's per-op pick); the result's bits
        do not depend on it. ``isa``: for tests, a path other than the best (same bits); None: ``BEST_ISA``, and for
        "int8" ``lib.ringshm_q8_isa(BEST_ISA)``.
        ``activations``: "float32" (the contract of csrc/matmul.h), or "int8": each row of x quantized per block of
        32 and summed in integers (matmul.h's 8-bit contract; still batch-invariant, not the fp32 result), for a
        quantized weight; a float weight runs fp32 either way (``ringshm.config.MATMUL_ACTIVATIONS``). With "int8"
        the AVX-512 path uses VNNI + VBMI where the CPU has them (``lib.ringshm_q8_isa``); ``isa`` may name
        ``lib.RINGSHM_ISA_AVX512_VNNI`` (the plain AVX-512 path where a weight has no 8-bit path).

        Raises:
            ValueError: ``x`` not contiguous fp32 CPU ``[M, k]`` with M ≥ 1; a residual of another shape; an
                unknown ``activations``.
        """
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != self.k or x.shape[0] < 1 \
                or x.device.type != "cpu":
            raise ValueError(f"matmul with a [{self.n}, {self.k}] weight takes fp32 CPU x [M, {self.k}], M ≥ 1; "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        if activations not in MATMUL_ACTIVATIONS:
            raise ValueError(f"activations must be one of {MATMUL_ACTIVATIONS}, got {activations!r}")
        x = x.contiguous()
        m = x.shape[0]
        res_ptr, ldr = ffi.NULL, 0
        if residual is not None:
            if residual.dtype is not torch.float32 or tuple(residual.shape) != (m, self.n) \
                    or residual.device.type != "cpu":
                raise ValueError(f"residual must be fp32 CPU [{m}, {self.n}], got {residual.dtype} "
                                 f"{tuple(residual.shape)} on {residual.device}")
            if residual.stride(1) != 1 or (m > 1 and residual.stride(0) < self.n):
                residual = residual.contiguous()  # a broadcast or transposed view: one copy
            res_ptr, ldr = ffi.cast("float *", residual.data_ptr()), max(residual.stride(0), self.n)
        out = torch.empty((m, self.n_padded), dtype=torch.float32)
        nt = torch.get_num_threads() if threads is None else threads
        bias_len = 0 if self.bias is None else self.bias.numel()
        out_ptr = ffi.cast("float *", out.data_ptr())
        if activations == "int8" and lib.ringshm_q8_supported(self.qtype):
            xq = quantize_rows(x, nt, BEST_ISA if isa is None else isa)
            status = lib.ringshm_qmat_matmul_q8(self.qtype, self._ptr, self.packed.numel(), self.n, self.k,
                                                ffi.cast("uint8_t *", xq.data_ptr()), xq.numel(), m, out_ptr,
                                                self.n_padded, self._bias_ptr, bias_len, res_ptr, ldr, nt,
                                                lib.ringshm_q8_isa(BEST_ISA) if isa is None else isa)
        else:
            isa = BEST_ISA if isa is None or isa == lib.RINGSHM_ISA_AVX512_VNNI else isa
            status = lib.ringshm_qmat_matmul(self.qtype, self._ptr, self.packed.numel(), self.n, self.k,
                                             ffi.cast("float *", x.data_ptr()), m, out_ptr, self.n_padded,
                                             self._bias_ptr, bias_len, res_ptr, ldr, nt, isa)
        if status < 0:
            check_status(status, f"matmul {self!r}")
        return out if self.n_padded == self.n else out[:, : self.n].contiguous()


def quantize_rows(x: torch.Tensor, threads: int = 1, isa: int = BEST_ISA) -> torch.Tensor:
    """Rows of fp32 ``x [M, K]`` (K a multiple of 32) quantized for the 8-bit matmul (csrc/matmul.h: per row and
    block of 32, d = max |x| / 127): uint8 ``[ringshm_q8_act_bytes(M, K)]``, 48 bytes a block; ``isa``, for tests
    (every path gives the same bytes).

    Raises:
        ValueError: x not contiguous fp32 CPU ``[M, K]`` with K % 32 == 0.
    """
    if x.dtype is not torch.float32 or x.dim() != 2 or x.device.type != "cpu" or not x.is_contiguous() \
            or x.shape[0] < 1 or x.shape[1] < 32 or x.shape[1] % 32:
        raise ValueError(f"quantize_rows takes contiguous fp32 CPU x [M, K], K a multiple of 32; got {x.dtype} "
                         f"{tuple(x.shape)}")
    m, k = x.shape
    xq = torch.empty(int(lib.ringshm_q8_act_bytes(m, k)), dtype=torch.uint8)
    check_status(lib.ringshm_q8_quantize(ffi.cast("float *", x.data_ptr()), m, k,
                                         ffi.cast("uint8_t *", xq.data_ptr()), xq.numel(), threads, isa),
                 "quantize_rows")
    return xq


class PackedExperts:
    """The routed experts of one role and layer: ``E`` weights ``[n, k]`` of one encoding, each packed as
    ``PackedWeight`` packs it, one after another in ``packed`` (``stride`` bytes apart: csrc/layer.h's
    ``exp_*`` fields). Experts of different encodings (an HF directory's may differ) are all widened to F32.

    Raises:
        ValueError: no experts, or experts of different shapes (the message says which).
    """

    def __init__(self, raws: Sequence[RawWeight]) -> None:
        if not raws or len({(r.n, r.k) for r in raws}) != 1:
            raise ValueError(f"PackedExperts takes one or more experts of one shape, got "
                             f"{sorted({(r.n, r.k) for r in raws})}")
        if len({r.qtype for r in raws}) > 1:
            raws = [r.to_f32() for r in raws]
        self.qtype, self.n, self.k, self.n_experts = raws[0].qtype, raws[0].n, raws[0].k, len(raws)
        size = lib.ringshm_qmat_packed_bytes(self.qtype, self.n, self.k)
        self.stride = int(check_status(size, "PackedExperts"))
        self.packed = weight_buffer(self.stride * len(raws))
        for e, raw in enumerate(raws):
            src = raw.data.contiguous()
            check_status(lib.ringshm_qmat_pack(self.qtype, ffi.cast("uint8_t *", src.data_ptr()), src.numel(),
                                               self.n, self.k, ffi.cast("uint8_t *", self.packed.data_ptr())
                                               + e * self.stride, self.stride), f"PackedExperts expert {e}")

    def __repr__(self) -> str:
        return (f"PackedExperts({self.n_experts} x {type_name(self.qtype)}, n={self.n}, k={self.k}, "
                f"{self.packed.numel()} bytes)")


def row_prefetch() -> bool:
    """Whether the one-row fp32 matmuls started from now on ask for the packed rows ahead (software prefetch) of the
    types read in the order they are stored, and attention for its next fp32 KV tile: ``row_prefetch_for(F32, 1)``.
    No bit of any result depends on it."""
    return bool(lib.ringshm_mm_row_prefetch())


def row_prefetch_for(qtype: int, m: int, activations: str = "float32") -> bool:
    """Whether a matmul of ``m`` rows of weight type ``qtype`` (``activations`` "float32" or "int8") started from now
    on asks for the packed rows ahead of the types read in order (Q5_0, Q5_1, Q5_K and Q6_K ask for their own bytes
    either way, whatever this says): the CPU's choice (csrc/matmul.c has the measurements): every op on AMD Zen 5
    and later; on AMD Zen 4 the fp32 ops of 4 rows or more (6 or more for a float weight), no one-row or 8-bit op;
    no op elsewhere. ``set_row_prefetch`` forces every op on or off.

    Raises:
        ValueError: ``m`` < 1 or an unknown ``activations``.
    """
    if m < 1 or activations not in MATMUL_ACTIVATIONS:
        raise ValueError(f"row_prefetch_for takes m >= 1 and activations in {MATMUL_ACTIVATIONS}, got {m}, "
                         f"{activations!r}")
    return bool(lib.ringshm_mm_row_prefetch_for(qtype, m, int(activations == "int8")))


def set_row_prefetch(on: bool | None) -> bool:
    """Force the row prefetch on (True) or off (False) for every later matmul of this process, whatever its rows, or
    give it back to the CPU's choice (None: ``row_prefetch_for``); returns ``row_prefetch()`` after it. For tests
    and benches that compare the two (the bits never change); not while another thread runs a matmul.

    Raises:
        TypeError: ``on`` not a bool or None.
    """
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"set_row_prefetch takes True, False or None, got {on!r}")
    return bool(check_status(lib.ringshm_mm_set_row_prefetch(-1 if on is None else int(on)), "set_row_prefetch"))


def fma_probe(iters: int, threads: int = 1, isa: int = BEST_ISA) -> int:
    """Run the fp32 FMA peak probe of an ISA path (``ringshm_fma_probe``, csrc/matmul.h): ``threads`` OpenMP
    threads each run ``iters`` rounds of independent 16-lane fma chains. Time the call to get the peak in
    flop/s (bench/bench_roofline.py). Returns the flops executed (2 per lane per fma).

    Raises:
        KernelError: an ISA this CPU cannot run, iters < 1 or threads < 1 (``ringshm.errors.check_status``).
    """
    sink = ffi.new("float[1]")
    flops = lib.ringshm_fma_probe(isa, threads, iters, sink)
    return int(check_status(flops, f"fma probe ({ISA_NAMES.get(isa, isa)}, {threads} threads)"))


def read_probe(buf: torch.Tensor, threads: int = 1, isa: int = BEST_ISA) -> int:
    """Run the memory read probe of an ISA path (``ringshm_read_probe``, csrc/matmul.h): ``threads`` OpenMP threads
    sum one contiguous part each of ``buf`` (fp32, contiguous, numel a multiple of 128). Time the call on a buffer
    larger than the last-level cache to get the bandwidth a stage can stream (bench/bench_roofline.py). Returns
    the bytes read.

    Raises:
        ValueError: ``buf`` not a contiguous CPU fp32 tensor. KernelError: an ISA this CPU cannot run, a numel that
            is not a positive multiple of 128, threads < 1.
    """
    if buf.dtype != torch.float32 or not buf.is_contiguous() or buf.device.type != "cpu":
        raise ValueError(f"read_probe takes a contiguous CPU fp32 tensor, got {buf.dtype} on {buf.device}")
    sink = ffi.new("float[1]")
    nbytes = lib.ringshm_read_probe(isa, threads, ffi.cast("float *", buf.data_ptr()), buf.numel(), sink)
    return int(check_status(nbytes, f"read probe ({ISA_NAMES.get(isa, isa)}, {threads} threads)"))
