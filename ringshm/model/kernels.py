"""RoPE, KV-append and causal GQA attention over a KV-cache row: shape checks here, then one C call.

Dispatch lives in one place (``_c_path``): contiguous CPU fp32 tensors with a head_dim the C kernel takes
(a multiple of 16, at most ``MAX_HEAD_DIM``) go to ``ringshm._C`` (csrc/kernels.c); everything else (CUDA,
bf16, odd head_dims) runs the plain torch reference below, which the tests also use as the oracle.

Shapes follow the cache layout of ``ringshm.model.stage_model``: the per-layer cache is ``[R, Hkv, S_max, D]`` (R rows,
S_max positions), and ``cache[row]`` is one contiguous ``[Hkv, S_max, D]`` row. A chunk of n tokens sits at
absolute positions ``start .. start + n - 1`` of its row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ringshm._C import ffi, lib
from ringshm.errors import KVRangeError

MAX_HEAD_DIM: int = lib.ringshm_attn_max_head_dim()
"""Largest head_dim the C attention takes (its state lives in fixed stack buffers); larger D runs in torch."""

HEAD_DIM_MULTIPLE = 16
"""The C attention takes head_dims that are a multiple of this (one 16-float vector); others run in torch."""

STATUS_TEXT = {
    lib.RINGSHM_KERNEL_ERR_SHAPE: "bad shape (a dimension <= 0, head_dim not a multiple of 16 or too large, "
    "or Hq not a multiple of Hkv)",
    lib.RINGSHM_KERNEL_ERR_RANGE: "positions or rows out of range (start + n past S_max, or row outside [0, R))",
}


def _check(status: int, what: str) -> None:
    """Map a C kernel status to an exception; Python checks run first, so reaching here is a bug or bad data."""
    if status == lib.RINGSHM_KERNEL_OK:
        return
    msg = f"{what}: {STATUS_TEXT.get(status, f'unknown C status {status}')}"
    if status == lib.RINGSHM_KERNEL_ERR_RANGE:
        raise KVRangeError(msg)
    raise ValueError(msg)


def _f32p(t: torch.Tensor):
    return ffi.cast("float *", t.data_ptr())


def _c_path(*ts: torch.Tensor) -> bool:
    """The one dispatch rule: every tensor on CPU in fp32 runs the C kernel (contiguity is checked by callers)."""
    for t in ts:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def _attn_c_ok(head_dim: int) -> bool:
    return head_dim % HEAD_DIM_MULTIPLE == 0 and head_dim <= MAX_HEAD_DIM


def _same_placement(what: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise ValueError(f"{what}: {name} is {t.dtype}, expected {ref.dtype} like the others")
        if t.device != ref.device:
            raise ValueError(f"{what}: {name} is on {t.device}, expected {ref.device} like the others")


def _need_contiguous(what: str, **ts: torch.Tensor) -> None:
    for name, t in ts.items():
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous (pass cache[row] of a contiguous [R, Hkv, S_max, D] cache)")


# --- RoPE -------------------------------------------------------------------------------------------------------


def rope_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0, device="cpu",
                inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE angle tables for positions ``0 .. max_seq_len - 1``.

    Returns ``(cos, sin)``, each fp32 ``[max_seq_len, head_dim // 2]``: entry ``[p, i]`` is ``cos/sin(p * f_i)``
    with ``f_i`` = ``inv_freq[i]`` (``ringshm.model.rope``: scalings, Gemma's local base), by default
    ``1 / theta ** (2i / head_dim)`` (RoFormer, Su et al. 2021). Computed exactly as transformers' rotary
    embeddings do in fp32, so the angles match its bits: one fp32 product ``p * f_i`` per entry.

    Raises:
        ValueError: head_dim not a positive even number, max_seq_len < 1, or inv_freq not fp32 ``[head_dim/2]``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"rope_tables: head_dim must be a positive even number, got {head_dim}")
    if max_seq_len < 1:
        raise ValueError(f"rope_tables: max_seq_len must be >= 1, got {max_seq_len}")
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [D/2]
    elif inv_freq.dtype != torch.float32 or tuple(inv_freq.shape) != (head_dim // 2,):
        raise ValueError(f"rope_tables: inv_freq must be fp32 [{head_dim // 2}], got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")
    pos = torch.arange(max_seq_len, dtype=torch.int64).float()  # [P]
    freqs = torch.outer(pos, inv_freq.cpu())  # [P, D/2]
    return freqs.cos().contiguous().to(device), freqs.sin().contiguous().to(device)


def _check_tables(what: str, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, device) -> None:
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2:
        raise ValueError(
            f"{what}: cos and sin must both be [max_seq_len, {head_dim // 2}] (from rope_tables(head_dim={head_dim}, ...)),"
            f" got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"{what}: cos and sin must be fp32 (rope_tables makes them so), got {cos.dtype}, {sin.dtype}")
    if cos.device != device or sin.device != device:
        raise ValueError(f"{what}: cos and sin are on {cos.device}, expected {device} like the tensors they rotate")
    _need_contiguous(what, cos=cos, sin=sin)


def apply_rope_reference(x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Torch RoPE, rotate-half layout; the fallback of ``apply_rope`` and the tests' oracle. Same contract."""
    n, _, d = x.shape
    c = cos[start : start + n, None, :]  # [n, 1, D/2]
    s = sin[start : start + n, None, :]
    x0, x1 = x.float()[..., : d // 2], x.float()[..., d // 2 :]  # [n, H, D/2] each
    return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).to(x.dtype)


def apply_rope(x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by RoPE at positions ``start .. start + n - 1``; returns a new tensor, ``x`` is not changed.

    Args:
        x: ``[n, H, D]`` fp32 or bf16 (queries or keys of one chunk), D even.
        start: absolute position of ``x[0]``.
        cos, sin: fp32 ``[P, D/2]`` from ``rope_tables``, on x's device; P >= start + n.

    Layout is rotate-half (GPT-NeoX / Hugging Face Llama): dims i and i + D/2 rotate together. bf16 is rotated
    in fp32 and rounded once.

    Returns:
        ``[n, H, D]``, x's dtype and device.

    Raises:
        ValueError: x not 3-d, D odd, tables of the wrong shape/dtype/device, start < 0.
        KVRangeError (a ValueError): start + n beyond the tables.
    """
    if x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"apply_rope: x must be [n, H, D] with D even, got {tuple(x.shape)}")
    n, h, d = x.shape
    if start < 0:
        raise ValueError(f"apply_rope: start must be >= 0, got {start}")
    if not (cos.dim() == 2 and cos.shape == sin.shape and 2 * cos.shape[1] == d and _c_path(x, cos, sin)
            and cos.is_contiguous() and sin.is_contiguous()):
        _check_tables("apply_rope", cos, sin, d, x.device)  # raises with the details, or passes a torch-path call
    if start + n > cos.shape[0]:
        raise KVRangeError(f"apply_rope: positions up to {start + n - 1} but the RoPE tables cover only "
                           f"{cos.shape[0]}; build them with a larger max_seq_len")
    if not _c_path(x) or n == 0:
        return apply_rope_reference(x, start, cos, sin)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((n, h, d), dtype=torch.float32)
    status = lib.ringshm_rope_apply(_f32p(out), _f32p(x), _f32p(cos), _f32p(sin), n, h, d, start, cos.shape[0])
    if status:
        _check(status, "apply_rope")
    return out


# --- KV append --------------------------------------------------------------------------------------------------


def kv_append_reference(k_cache, v_cache, k, v, start, cos, sin) -> None:
    """Torch KV-append; the fallback of ``kv_append`` and the tests' oracle. Same contract."""
    n = k.shape[0]
    k_cache[:, start : start + n] = apply_rope_reference(k, start, cos, sin).transpose(0, 1).to(k_cache.dtype)
    v_cache[:, start : start + n] = v.transpose(0, 1).to(v_cache.dtype)  # [n, Hkv, D] -> [Hkv, n, D]


def kv_append(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
              cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the chunk's keys by RoPE and write keys and values into one cache row, in place.

    Args:
        k_cache, v_cache: one row of the layer's cache, ``[Hkv, S_max, D]``, contiguous (``cache[row]`` of a
            contiguous ``[R, Hkv, S_max, D]`` cache). Written at positions ``[start, start + n)`` only; writing
            below the row's current length overwrites (speculative rollback).
        k, v: ``[n, Hkv, D]``, the chunk's keys (not yet rotated) and values; same dtype/device as the cache.
        start: absolute position of the chunk's first token.
        cos, sin: fp32 ``[P, D/2]`` from ``rope_tables``, P >= start + n.

    fp32 on CPU runs the C kernel; other dtypes/devices run ``kv_append_reference`` (bf16 rotated in fp32).

    Raises:
        ValueError: shapes, dtypes or devices that do not match, a non-contiguous cache row, start < 0.
        KVRangeError (a ValueError): start + n > S_max, or beyond the RoPE tables. Nothing is written.
    """
    if not _kv_append_fast_ok(k_cache, v_cache, k, v, cos, sin):
        _check_kv_append(k_cache, v_cache, k, v, cos, sin)  # raises with the details, or passes a torch-path call
    hkv, smax, d = k_cache.shape
    n = k.shape[0]
    if start < 0:
        raise ValueError(f"kv_append: start must be >= 0, got {start}")
    if start + n > smax:
        raise KVRangeError(f"kv_append: writing positions [{start}, {start + n}) overflows the cache row "
                           f"(S_max = {smax}); nothing was written")
    if start + n > cos.shape[0]:
        raise KVRangeError(f"kv_append: positions up to {start + n - 1} but the RoPE tables cover only "
                           f"{cos.shape[0]}; build them with a larger max_seq_len")
    if n == 0:
        return
    if not _c_path(k_cache):
        kv_append_reference(k_cache, v_cache, k, v, start, cos, sin)
        return
    if not (k.is_contiguous() and v.is_contiguous()):
        k, v = k.contiguous(), v.contiguous()
    status = lib.ringshm_kv_append(_f32p(k_cache), _f32p(v_cache), _f32p(k), _f32p(v), _f32p(cos), _f32p(sin),
                                   n, hkv, smax, d, start, cos.shape[0])
    if status:
        _check(status, "kv_append")


def _kv_append_fast_ok(k_cache, v_cache, k, v, cos, sin) -> bool:
    """All of _check_kv_append's conditions for the C path, as cheap comparisons (runs once per layer per op)."""
    if k_cache.dim() != 3 or k.dim() != 3 or cos.dim() != 2:
        return False
    hkv, _, d = k_cache.shape
    ks = k.shape
    return (v_cache.shape == k_cache.shape and v.shape == ks and ks[1] == hkv and ks[2] == d and d % 2 == 0
            and cos.shape == sin.shape and 2 * cos.shape[1] == d and _c_path(k_cache, v_cache, k, v, cos, sin)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())


def _check_kv_append(k_cache, v_cache, k, v, cos, sin) -> None:
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"kv_append: k_cache and v_cache must both be one cache row [Hkv, S_max, D] (cache[row]), "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hkv, _, d = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (hkv, d):
        raise ValueError(f"kv_append: k and v must both be [n, {hkv}, {d}] to match the cache row, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if d % 2:
        raise ValueError(f"kv_append: head_dim must be even for RoPE, got {d}")
    _same_placement("kv_append", k_cache, v_cache=v_cache, k=k, v=v)
    _need_contiguous("kv_append", k_cache=k_cache, v_cache=v_cache)
    _check_tables("kv_append", cos, sin, d, k.device)


# --- attention --------------------------------------------------------------------------------------------------


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                        window: int = 0, scale: float | None = None) -> torch.Tensor:
    """Plain torch attention (matmul, mask, softmax, matmul in fp32); the fallback of ``attention``, the oracle.

    Same contract as ``attention``; no checks of its own.
    """
    n, hq, d = q.shape
    hkv = k_cache.shape[0]
    n_keys = start + n
    k = k_cache[:, :n_keys].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, L, D]
    v = v_cache[:, :n_keys].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, L, D]
    scores = q.float().transpose(0, 1) @ k.transpose(1, 2) * _scale(d, scale)  # [Hq, n, L]
    key_pos = torch.arange(n_keys, device=q.device)  # [L]
    query_pos = start + torch.arange(n, device=q.device)  # [n]
    masked = key_pos[None, :] > query_pos[:, None]  # bottom-right causal
    if window:
        masked |= key_pos[None, :] <= query_pos[:, None] - window  # the window's latest keys only
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [Hq, n, D]
    return out.transpose(0, 1).to(q.dtype)  # [n, Hq, D]


def _scale(head_dim: int, scale: float | None) -> float:
    """The factor on q · k: ``scale``, or 1 / sqrt(head_dim) (``ModelConfig.attention_scale``)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def attention_segments_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                                 starts: torch.Tensor, lens: torch.Tensor, window: int = 0,
                                 scale: float | None = None) -> torch.Tensor:
    """Torch form of ``attention_segments``: one ``attention_reference`` per segment. Same contract."""
    out, o = [], 0
    for r, s, n in zip(rows.tolist(), starts.tolist(), lens.tolist()):
        out.append(attention_reference(q[o:o + n], k_cache[r], v_cache[r], s, window, scale))
        o += n
    return torch.cat(out) if out else torch.empty_like(q)


def _check_window_scale(what: str, window: int, scale: float | None) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"{what}: window must be an int >= 0 (0: no sliding window), got {window!r}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what}: scale must be a finite number > 0, got {scale!r}")


def _check_attention_shapes(what: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cache_dims: int) -> tuple[int, int, int, int, int]:
    """Shared checks of q ``[n, Hq, D]`` against one cache row ``[Hkv, S_max, D]`` (``cache_dims`` 3) or the
    layer's cache ``[R, Hkv, S_max, D]`` (4); returns (n, Hq, Hkv, S_max, D)."""
    cache_shape = "[Hkv, S_max, D] (cache[row])" if cache_dims == 3 else "[R, Hkv, S_max, D] (the layer's cache)"
    if q.dim() != 3:
        raise ValueError(f"{what}: q must be [n, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != cache_dims or v_cache.shape != k_cache.shape:
        raise ValueError(f"{what}: k_cache and v_cache must both be {cache_shape}, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    n, hq, d = q.shape[-3:]
    hkv, smax, d_cache = k_cache.shape[-3:]
    if d != d_cache:
        raise ValueError(f"{what}: q's head_dim {d} differs from the cache's {d_cache}")
    if hq % hkv:
        raise ValueError(f"{what}: query heads ({hq}) must be a multiple of kv heads ({hkv}) for GQA")
    _same_placement(what, q, k_cache=k_cache, v_cache=v_cache)
    _need_contiguous(what, k_cache=k_cache, v_cache=v_cache)
    return n, hq, hkv, smax, d


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int, window: int = 0,
              scale: float | None = None) -> torch.Tensor:
    """Causal GQA attention of a chunk of n queries against one KV-cache row.

    Args:
        q: ``[n, Hq, D]``, already rotated by RoPE; query j sits at absolute position ``start + j``.
        k_cache, v_cache: one cache row ``[Hkv, S_max, D]``, contiguous, same dtype/device as q; positions
            ``[0, start + n)`` are read (the chunk's own keys must already be appended).
        start: absolute position of the chunk's first token.
        window: a sliding window of that many keys (itself included); 0: none.
        scale: the factor on q · k (default ``1 / sqrt(D)``).

    Query j at position p sees keys ``0 .. p`` (causal mask aligned bottom-right), or with a window only the
    latest ``window`` of them (``p - window < t <= p``, transformers' sliding-window mask); query head h reads kv
    head ``h // (Hq // Hkv)``; softmax max-subtracted, accumulated in fp32.
    CPU fp32 with D a multiple of 16 and at most ``MAX_HEAD_DIM`` runs the C kernel (online softmax, single
    thread); there each output row is bitwise independent of n and of the other rows, so decoding position p
    gives the same bits as row p of a verify chunk. Anything else runs ``attention_reference``.

    Returns:
        ``[n, Hq, D]``, q's dtype and device.

    Raises:
        ValueError: shapes that do not fit together, Hq not a multiple of Hkv, mixed dtypes/devices,
            a non-contiguous cache row, start < 0.
        KVRangeError (a ValueError): start + n > S_max.
    """
    if q.dim() != 3 or k_cache.dim() != 3:
        _check_attention_shapes("attention", q, k_cache, v_cache, cache_dims=3)  # raises with the details
    n, hq, d = q.shape
    hkv, smax, d_cache = k_cache.shape
    # the hot path (decode, verify) comes through here once per layer: cheap checks first, messages on failure
    if (v_cache.shape != k_cache.shape or d != d_cache or hq % hkv or not _c_path(q, k_cache, v_cache)
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        _check_attention_shapes("attention", q, k_cache, v_cache, cache_dims=3)
    if start < 0:
        raise ValueError(f"attention: start must be >= 0, got {start}")
    if window or scale is not None:
        _check_window_scale("attention", window, scale)
    if start + n > smax:
        raise KVRangeError(f"attention: positions [{start}, {start + n}) run past the cache row (S_max = {smax})")
    if n == 0 or not (_c_path(q) and _attn_c_ok(d)):
        return attention_reference(q, k_cache, v_cache, start, window, scale)
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty((n, hq, d), dtype=torch.float32)
    status = lib.ringshm_attn_forward(_f32p(out), _f32p(q), _f32p(k_cache), _f32p(v_cache), n, hq, hkv, smax, d, start,
                                      window, _scale(d, scale))
    if status:
        _check(status, "attention")
    return out


MAX_SEGMENTS: int = lib.ringshm_attn_max_segments()


def attention_segments(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                       starts: torch.Tensor, lens: torch.Tensor, n_threads: int | None = None, window: int = 0,
                       scale: float | None = None) -> torch.Tensor:
    """Attention of a ragged batch of segments, each on its own cache row (a step op's attention).

    Args:
        q: ``[T, Hq, D]``, already rotated: segment i's ``lens[i]`` queries follow segment i-1's; its query j
            sits at position ``starts[i] + j``.
        k_cache, v_cache: the layer's whole cache ``[R, Hkv, S_max, D]``, contiguous, same dtype/device as q.
        rows, starts, lens: int64 ``[n_seg]`` (CPU): each segment's cache row in ``[0, R)`` (may repeat), start
            ``>= 0`` and token count ``>= 1``, ``starts[i] + lens[i] <= S_max``, ``sum(lens) == T``,
            ``n_seg <= MAX_SEGMENTS``.
        n_threads: OpenMP threads over (segment, kv head) items (default: torch's intra-op threads).
        window, scale: as ``attention``.

    ``out[segment i] == attention(q[segment i], k_cache[rows[i]], v_cache[rows[i]], starts[i], window, scale)``,
    bitwise on the C path, whatever ``n_threads`` and the other segments (csrc/kernels.h).

    Returns:
        ``[T, Hq, D]``, q's dtype and device.

    Raises:
        ValueError: as ``attention``; rows/starts/lens not int64 ``[n_seg]`` CPU tensors, a length < 1, lengths
            that do not sum to T, or too many segments.
        KVRangeError (a ValueError): a row outside ``[0, R)``, a start < 0 or ``starts[i] + lens[i] > S_max``.
            Nothing is computed.
    """
    _, hq, hkv, smax, d = _check_attention_shapes("attention_segments", q, k_cache, v_cache, cache_dims=4)
    _check_window_scale("attention_segments", window, scale)
    n_seg = rows.shape[0] if rows.dim() == 1 else -1
    for name, t in (("rows", rows), ("starts", starts), ("lens", lens)):
        if t.dtype != torch.int64 or t.shape != (n_seg,) or t.device.type != "cpu":
            raise ValueError(f"attention_segments: {name} must be int64 CPU [n_seg] = [{n_seg}], got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if n_seg > MAX_SEGMENTS:
        raise ValueError(f"attention_segments: at most {MAX_SEGMENTS} segments per call, got {n_seg}")
    if bool((lens < 1).any()) or int(lens.sum()) != q.shape[0]:
        raise ValueError(f"attention_segments: lens must be >= 1 and sum to T = {q.shape[0]}, got {lens.tolist()}")
    n_rows = k_cache.shape[0]
    if bool((rows < 0).any() | (rows >= n_rows).any() | (starts < 0).any() | (starts + lens > smax).any()):
        raise KVRangeError(f"attention_segments: rows must lie in [0, {n_rows}) and starts + lens in [0, {smax}]; "
                           f"got rows {rows.tolist()}, starts {starts.tolist()}, lens {lens.tolist()}")
    if n_seg == 0:
        return torch.empty_like(q)
    if not (_c_path(q) and _attn_c_ok(d)):
        return attention_segments_reference(q, k_cache, v_cache, rows, starts, lens, window, scale)
    q = q.contiguous()
    rows, starts, lens = rows.contiguous(), starts.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    i64 = lambda t: ffi.cast("int64_t *", t.data_ptr())  # noqa: E731
    status = lib.ringshm_attn_forward_segments(
        _f32p(out), _f32p(q), _f32p(k_cache), _f32p(v_cache), i64(rows), i64(starts), i64(lens), n_seg, n_rows,
        hq, hkv, smax, d, window, _scale(d, scale), torch.get_num_threads() if n_threads is None else n_threads)
    _check(status, "attention_segments")
    return out


# --- RMSNorm and SwiGLU (batch-invariant: each row in a fixed order) ----------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of fp32 CPU ``x [T, K]`` with fp32 ``weight [K]``: a new ``[T, K]`` tensor.

    ``(x * (1 / sqrt(mean(x²) + eps))) * weight`` (Hugging Face ``LlamaRMSNorm``'s order of ops), the sum of
    squares in a fixed order per row (csrc/kernels.h), so a row's bits do not depend on the other rows.

    Raises:
        ValueError: shapes, dtypes or devices other than the above; ``eps`` < 0.
    """
    if x.dim() != 2 or x.dtype is not torch.float32 or weight.dtype is not torch.float32 \
            or tuple(weight.shape) != (x.shape[1],) or not x.is_cpu or not weight.is_cpu or x.shape[0] < 1:
        raise ValueError(f"rms_norm takes fp32 CPU x [T ≥ 1, K] and weight [K], got {x.dtype} {tuple(x.shape)}"
                         f" and {weight.dtype} {tuple(weight.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _check(lib.ringshm_rms_norm(_f32p(out), _f32p(x), _f32p(weight.contiguous()), x.shape[0], x.shape[1], eps),
           "rms_norm")
    return out


def act_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """The MLP's gate: ``act(gate) * up`` for fp32 CPU ``gate_up [T, 2I]`` (rows ``[gate | up]``) → ``[T, I]``.

    ``activation``: "silu" (SwiGLU, Llama) or "gelu_tanh" (GeGLU, Gemma: transformers' gelu_pytorch_tanh).
    Each element by the same vector code (csrc/kernels.h), so its bits depend only on its two inputs.

    Raises:
        ValueError: not a 2-D fp32 CPU tensor with an even, positive number of columns; another activation.
    """
    if gate_up.dim() != 2 or gate_up.dtype is not torch.float32 or not gate_up.is_cpu or gate_up.shape[1] % 2 \
            or gate_up.shape[1] == 0 or gate_up.shape[0] < 1:
        raise ValueError(f"act_mul takes fp32 CPU [T ≥ 1, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    fn = {"silu": lib.ringshm_silu_mul, "gelu_tanh": lib.ringshm_gelu_tanh_mul}.get(activation)
    if fn is None:
        raise ValueError(f"act_mul: activation {activation!r} is not silu or gelu_tanh")
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=torch.float32)
    _check(fn(_f32p(out), _f32p(gate_up), gate_up.shape[0], inter), "act_mul")
    return out


def act_mul_reference(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """Torch form of ``act_mul`` (any dtype and device): ``silu`` or tanh-``gelu`` of the gate times up."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up
