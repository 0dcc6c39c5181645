"""Paged KV: a layer's keys and values in blocks (``KVPool``), KV-append into a stream's blocks, and causal GQA
attention through its block table; shape checks here, then one C call (csrc/kernels.h).

    pool   k, v [n_blocks, Hkv, B, D] in the KV dtype (fp32, fp16 or bf16): block b holds B consecutive positions
           of whichever stream's table names it
    table  int32 [ceil(end / B)]: a stream's blocks in position order; position p lives in block table[p // B] at
           offset p % B. The coordinator owns tables (ringshm.engine.kv_blocks); a stage only follows them.

CPU fp32 activations with a head_dim the C kernel takes (a multiple of 16, at most ``MAX_HEAD_DIM``) run
``ringshm._C``; everything else (CUDA, bf16 activations) runs the torch references below, which gather a stream's
blocks into one contiguous row (the tests' oracle too). A 16-bit KV dtype is stored rounded to nearest even once,
on append, and read widened exactly to fp32: attention still accumulates in fp32. On the C path an output row's
bits depend only on its query, its position and the keys: not on the other rows or segments of the op, the
thread count, the block size or where the blocks sit.

Which positions a block holds is tracked per stage in ``fill`` int32 ``[n_blocks]``: ``kv_check`` refuses an op
that would read KV never written (nothing changes), ``kv_mark`` records what a checked op wrote.
"""

from __future__ import annotations

import math

import torch

from ringshm._C import ffi, lib
from ringshm.errors import KVRangeError, check_status
from ringshm.model.kernels import apply_rope_reference, check_rope_tables, f32_ptr

MAX_HEAD_DIM: int = lib.ringshm_attn_max_head_dim()
"""Largest head_dim the C attention takes (its state lives in fixed stack buffers); larger D runs in torch."""
HEAD_DIM_MULTIPLE = 16
"""The C attention takes head_dims that are a multiple of this (one 16-float vector); others run in torch."""
MAX_SEGMENTS: int = lib.ringshm_attn_max_segments()
MAX_BLOCK: int = lib.ringshm_kv_max_block()
"""Largest KV block (positions) the C attention takes."""
KEY_TILE: int = lib.ringshm_kv_key_tile()
"""Keys per online-softmax step of the C attention (32): block sizes are multiples of it, so the bits do not
depend on the block size."""


KV_DTYPES: dict[torch.dtype, int] = {torch.float32: lib.RINGSHM_KV_F32, torch.float16: lib.RINGSHM_KV_F16,
                                     torch.bfloat16: lib.RINGSHM_KV_BF16}
"""The KV dtypes the C kernels store and read, with their ``enum ringshm_kv_type``."""


def table_len(end: int, block_size: int) -> int:
    """Blocks a table needs to cover positions ``[0, end)``: ``ceil(end / block_size)``."""
    return -(-end // block_size)


class KVPool:
    """One layer's paged KV cache: ``k``, ``v`` of ``[n_blocks, Hkv, B, D]`` in ``dtype`` (zeros at first) and,
    on the C path (CPU, a dtype of ``KV_DTYPES``, a head_dim the kernel takes), the ``struct ringshm_kv_pool``
    over them (``c``).

    Raises:
        ValueError: a dimension < 1, B not a multiple of ``KEY_TILE`` or over ``MAX_BLOCK``.
    """

    def __init__(self, n_blocks: int, n_kv_heads: int, block_size: int, head_dim: int, device="cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        if min(n_blocks, n_kv_heads, block_size, head_dim) < 1 or block_size % KEY_TILE or block_size > MAX_BLOCK:
            raise ValueError(f"KVPool: n_blocks, n_kv_heads, head_dim >= 1 and a block size that is a multiple of "
                             f"{KEY_TILE} up to {MAX_BLOCK}; got {n_blocks}, {n_kv_heads}, {block_size}, {head_dim}")
        shape = (n_blocks, n_kv_heads, block_size, head_dim)  # [n_blocks, Hkv, B, D]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.n_blocks, self.n_kv_heads, self.block_size, self.head_dim = shape
        self.native = self.k.is_cpu and dtype in KV_DTYPES and head_dim % HEAD_DIM_MULTIPLE == 0 \
            and head_dim <= MAX_HEAD_DIM
        self.c = ffi.new("struct ringshm_kv_pool *", dict(
            k=ffi.cast("void *", self.k.data_ptr()), v=ffi.cast("void *", self.v.data_ptr()), n_blocks=n_blocks,
            block_size=block_size, n_kv_heads=n_kv_heads, head_dim=head_dim, kv_type=KV_DTYPES[dtype],
            n_elems=self.k.numel())) if self.native else None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def row(self, table: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A stream's positions ``[0, end)`` gathered into contiguous ``[Hkv, end, D]`` keys and values (a copy:
        the torch path's view of its KV, and the tests')."""
        blocks = table[:table_len(end, self.block_size)].long()
        k = self.k[blocks].transpose(0, 1).reshape(self.n_kv_heads, -1, self.head_dim)[:, :end]
        v = self.v[blocks].transpose(0, 1).reshape(self.n_kv_heads, -1, self.head_dim)[:, :end]
        return k, v


def _table(what: str, table: torch.Tensor, end: int, pool: KVPool) -> torch.Tensor:
    if table.dtype != torch.int32 or table.dim() != 1 or not table.is_cpu:
        raise ValueError(f"{what}: the block table must be int32 CPU [n_table], got {table.dtype} "
                         f"{tuple(table.shape)} on {table.device}")
    need = table_len(end, pool.block_size)
    if table.numel() < need:
        raise KVRangeError(f"{what}: positions up to {end - 1} need {need} blocks of {pool.block_size}, the table "
                           f"names {table.numel()}")
    used = table[:need]
    if bool(((used < 0) | (used >= pool.n_blocks)).any()):
        raise KVRangeError(f"{what}: block ids {used.tolist()[:8]} outside the pool [0, {pool.n_blocks})")
    return table.contiguous()


def _i32p(t: torch.Tensor):
    return ffi.cast("int32_t *", t.data_ptr())


def _i64p(t: torch.Tensor):
    return ffi.cast("int64_t *", t.data_ptr())


# --- KV append --------------------------------------------------------------------------------------------------
def kv_append_reference(pool: KVPool, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                        cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Torch KV-append; the fallback of ``kv_append`` and the tests' oracle. Same contract (torch's casts round
    to nearest even, as the C stores do)."""
    rk = apply_rope_reference(k, start, cos, sin).to(pool.k.dtype)
    for j in range(k.shape[0]):
        p = start + j
        b, o = int(table[p // pool.block_size]), p % pool.block_size
        pool.k[b, :, o] = rk[j]
        pool.v[b, :, o] = v[j].to(pool.v.dtype)


def kv_append(pool: KVPool, table: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
              cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate a chunk's keys by RoPE and write keys and values into its stream's blocks, in place.

    Args:
        pool: the layer's ``KVPool``; written at the chunk's positions only (writing where the stream wrote
            before overwrites: speculative rollback).
        table: int32 ``[n_table]``, the stream's blocks, covering at least ``start + n`` positions.
        k, v: ``[n, Hkv, D]``, the chunk's keys (not yet rotated) and values (fp32 on the C path; stored in the
            pool's dtype, rounded to nearest even), on the pool's device.
        start: absolute position of the chunk's first token. cos, sin: fp32 ``[P, D/2]`` (``rope_tables``).

    Raises:
        ValueError: shapes, dtypes or devices that do not match, start < 0.
        KVRangeError (a ValueError): a table too short or naming a block outside the pool, positions beyond the
            RoPE tables. Nothing is written.
    """
    n = k.shape[0] if k.dim() == 3 else -1
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (pool.n_kv_heads, pool.head_dim):
        raise ValueError(f"kv_append: k and v must both be [n, {pool.n_kv_heads}, {pool.head_dim}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if start < 0:
        raise ValueError(f"kv_append: start must be >= 0, got {start}")
    check_rope_tables("kv_append", cos, sin, pool.head_dim, k.device)
    if start + n > cos.shape[0]:
        raise KVRangeError(f"kv_append: positions up to {start + n - 1} but the RoPE tables cover only "
                           f"{cos.shape[0]}; build them with a larger max_seq_len")
    if n == 0:
        return
    table = _table("kv_append", table, start + n, pool)
    if not (pool.native and k.dtype == torch.float32 and k.is_cpu):
        kv_append_reference(pool, table, k, v, start, cos, sin)
        return
    k, v = k.contiguous(), v.contiguous()
    check_status(lib.ringshm_kv_append(pool.c, _i32p(table), table.numel(), f32_ptr(k), f32_ptr(v), f32_ptr(cos),
                                       f32_ptr(sin),
                                 n, start, cos.shape[0]), "kv_append")


# --- attention --------------------------------------------------------------------------------------------------
def _scale(head_dim: int, scale: float | None) -> float:
    """The factor on q · k: ``scale``, or 1 / sqrt(head_dim) (``ModelConfig.attention_scale``)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def _check_window_scale(what: str, window: int, scale: float | None) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{what}: window must be an int >= 0 (0: no sliding window), got {window!r}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what}: scale must be a finite number > 0, got {scale!r}")


def _sinks(what: str, sinks: torch.Tensor | None, hq: int) -> torch.Tensor | None:
    """``sinks`` as the C kernel reads it (fp32, contiguous, CPU) after checking it holds one logit per query head.

    Raises:
        ValueError: not ``[Hq]``."""
    if sinks is None:
        return None
    if sinks.dim() != 1 or sinks.numel() != hq:
        raise ValueError(f"{what}: sinks must be [{hq}] (one logit per query head), got {tuple(sinks.shape)}")
    return sinks.to("cpu", torch.float32).contiguous()


def _f32p_or_null(t: torch.Tensor | None):
    return ffi.NULL if t is None else f32_ptr(t)


def attention_reference(q: torch.Tensor, pool: KVPool, table: torch.Tensor, start: int, window: int = 0,
                        scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch attention over the stream's gathered KV (matmul, mask, softmax, matmul in fp32); the fallback
    of ``attention`` and the oracle. Same contract; no checks of its own. ``sinks [Hq]``: each head's sink logit
    joins the softmax as a last column and is dropped after it (transformers' GptOss eager attention)."""
    n, hq, d = q.shape
    n_keys = start + n
    k_row, v_row = pool.row(table, n_keys)  # [Hkv, L, D]
    g = hq // pool.n_kv_heads
    k = k_row.float().repeat_interleave(g, dim=0)  # [Hq, L, D]
    v = v_row.float().repeat_interleave(g, dim=0)
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * _scale(d, scale)  # [Hq, n, L]
    key_pos = torch.arange(n_keys, device=q.device)  # [L]
    query_pos = start + torch.arange(n, device=q.device)  # [n]
    masked = key_pos[None, :] > query_pos[:, None]  # bottom-right causal
    if window:
        masked |= key_pos[None, :] <= query_pos[:, None] - window  # the window's latest keys only
    scores = scores.masked_fill(masked, float("-inf"))
    if sinks is not None:  # [Hq, n, L + 1], the sink last
        scores = torch.cat([scores, sinks.float().to(q.device)[:, None, None].expand(hq, n, 1)], dim=-1)
        out = torch.softmax(scores, dim=-1)[..., :-1] @ v
    else:
        out = torch.softmax(scores, dim=-1) @ v  # [Hq, n, D]
    return out.transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def attention(q: torch.Tensor, pool: KVPool, table: torch.Tensor, start: int, window: int = 0,
              scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of a chunk of n queries through its stream's block table.

    Args:
        q: ``[n, Hq, D]``, already rotated by RoPE; query j sits at absolute position ``start + j``.
        pool: the layer's ``KVPool``; table: int32 ``[n_table]`` covering positions ``[0, start + n)``, which are
            read (the chunk's own keys must already be appended).
        start: absolute position of the chunk's first token.
        window: a sliding window of that many keys (itself included); 0: none.
        scale: the factor on q · k (default ``1 / sqrt(D)``).
        sinks: ``[Hq]`` fp32 attention sinks (gpt-oss): head h's softmax has one more logit, ``sinks[h]`` (not
            scaled), that weighs no value; None: none.

    Query j at position p sees keys ``0 .. p`` (causal mask aligned bottom-right), or with a window only the
    latest ``window`` of them (``p - window < t <= p``, transformers' sliding-window mask); query head h reads kv
    head ``h // (Hq // Hkv)``; softmax max-subtracted, accumulated in fp32 (csrc/kernels.h).

    Returns:
        ``[n, Hq, D]``, q's dtype and device.

    Raises:
        ValueError: shapes that do not fit the pool, Hq not a multiple of Hkv, start < 0, a bad window or scale.
        KVRangeError (a ValueError): a table too short or naming a block outside the pool.
    """
    if q.dim() != 3 or q.shape[2] != pool.head_dim or q.shape[1] % pool.n_kv_heads:
        raise ValueError(f"attention: q must be [n, Hq, {pool.head_dim}] with Hq a multiple of {pool.n_kv_heads}, "
                         f"got {tuple(q.shape)}")
    n, hq, d = q.shape
    if start < 0:
        raise ValueError(f"attention: start must be >= 0, got {start}")
    if window or scale is not None:
        _check_window_scale("attention", window, scale)
    if n == 0:
        return torch.empty_like(q)
    table = _table("attention", table, start + n, pool)
    if not (pool.native and q.dtype == torch.float32 and q.is_cpu):
        return attention_reference(q, pool, table, start, window, scale, sinks)
    q = q.contiguous()
    out = torch.empty((n, hq, d), dtype=torch.float32)
    sinks = _sinks("attention", sinks, hq)
    check_status(lib.ringshm_attn_forward(f32_ptr(out), f32_ptr(q), pool.c, _i32p(table), table.numel(), n, hq, start,
                                          window, _scale(d, scale), _f32p_or_null(sinks)), "attention")
    return out


def attention_segments(q: torch.Tensor, pool: KVPool, tables: torch.Tensor, table_offs: torch.Tensor,
                       starts: torch.Tensor, lens: torch.Tensor, n_threads: int | None = None, window: int = 0,
                       scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a ragged batch of segments, each through its own block table (a step op's attention).

    Args:
        q: ``[T, Hq, D]``, already rotated: segment i's ``lens[i]`` queries follow segment i-1's; its query j
            sits at position ``starts[i] + j``.
        pool: the layer's ``KVPool``.
        tables: int32 ``[Σ n_table]``, segment i's table at ``tables[table_offs[i]:table_offs[i + 1]]``;
            table_offs: int64 ``[n_seg + 1]``; starts, lens: int64 ``[n_seg]`` (CPU), ``sum(lens) == T``,
            ``n_seg <= MAX_SEGMENTS``.
        n_threads: OpenMP threads over (segment, kv head) items (default: torch's intra-op threads).
        window, scale, sinks: as ``attention``.

    ``out[segment i] == attention(q[segment i], pool, its table, starts[i], window, scale)``, bitwise on the C
    path, whatever ``n_threads`` and the other segments (csrc/kernels.h).

    Raises:
        ValueError: as ``attention``; tensors of the wrong dtype or shape, a length < 1, lengths that do not sum to
            T, or too many segments.
        KVRangeError (a ValueError): a table too short or naming a block outside the pool. Nothing is computed.
    """
    _check_window_scale("attention_segments", window, scale)
    n_seg = starts.numel()
    for name, t, dt, size in (("starts", starts, torch.int64, n_seg), ("lens", lens, torch.int64, n_seg),
                              ("table_offs", table_offs, torch.int64, n_seg + 1), ("tables", tables, torch.int32, -1)):
        if t.dtype != dt or t.dim() != 1 or (size >= 0 and t.numel() != size) or not t.is_cpu:
            raise ValueError(f"attention_segments: {name} must be {dt} CPU [{size if size >= 0 else 'n'}], got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if n_seg > MAX_SEGMENTS:
        raise ValueError(f"attention_segments: at most {MAX_SEGMENTS} segments per call, got {n_seg}")
    if bool((lens < 1).any()) or int(lens.sum()) != q.shape[0]:
        raise ValueError(f"attention_segments: lens must be >= 1 and sum to T = {q.shape[0]}, got {lens.tolist()}")
    if n_seg == 0:
        return torch.empty_like(q)
    if not (pool.native and q.dtype == torch.float32 and q.is_cpu):
        out, o = [], 0
        for i in range(n_seg):
            n, s = int(lens[i]), int(starts[i])
            t = _table("attention_segments", tables[int(table_offs[i]):int(table_offs[i + 1])], s + n, pool)
            out.append(attention_reference(q[o:o + n], pool, t, s, window, scale, sinks))
            o += n
        return torch.cat(out)
    q = q.contiguous()
    tables, table_offs, starts, lens = (t.contiguous() for t in (tables, table_offs, starts, lens))
    out = torch.empty_like(q)
    sinks = _sinks("attention_segments", sinks, q.shape[1])
    check_status(lib.ringshm_attn_forward_segments(
        f32_ptr(out), f32_ptr(q), pool.c, _i32p(tables), _i64p(table_offs), _i64p(starts), _i64p(lens), n_seg,
        q.shape[1], window, _scale(pool.head_dim, scale), _f32p_or_null(sinks),
        torch.get_num_threads() if n_threads is None else n_threads), "attention_segments")
    return out


# --- which positions the blocks hold ----------------------------------------------------------------------------
def kv_check(fill: torch.Tensor, block_size: int, tables: torch.Tensor, table_offs: torch.Tensor,
             starts: torch.Tensor, lens: torch.Tensor) -> int:
    """The first segment whose table is too short, names a block outside the pool, or reads a position its blocks
    do not hold (``fill``: int32 ``[n_blocks]``, positions written per block), or -1 when every segment may run
    (csrc/kernels.h ``ringshm_kv_check``). Changes nothing."""
    bad = ffi.new("int *", -1)
    status = lib.ringshm_kv_check(_i32p(fill), fill.numel(), block_size, _i32p(tables), _i64p(table_offs),
                                  _i64p(starts), _i64p(lens), starts.numel(), bad)
    return -1 if status == lib.RINGSHM_KERNEL_OK else bad[0]


def kv_mark(fill: torch.Tensor, block_size: int, tables: torch.Tensor, table_offs: torch.Tensor,
            starts: torch.Tensor, lens: torch.Tensor) -> None:
    """Record in ``fill`` the positions a checked op wrote (``ringshm_kv_mark``)."""
    lib.ringshm_kv_mark(_i32p(fill), block_size, _i32p(tables), _i64p(table_offs), _i64p(starts), _i64p(lens),
                        starts.numel())
