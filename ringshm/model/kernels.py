"""The per-row kernels around the matmuls: RoPE tables and rotation, RMSNorm and the MLP gates (SwiGLU,
GeGLU): shape checks here, then one C call (csrc/kernels.h); paged KV and attention are ``ringshm.model.attention``.

Dispatch lives in one place (``_c_path``): contiguous CPU fp32 tensors go to ``ringshm._C`` (its status codes
become exceptions in ``ringshm.errors.check_status``); everything else
(CUDA, bf16) runs the plain torch reference, which the tests also use as the oracle. Every C kernel here
computes a row in a fixed order, so a row's bits do not depend on the other rows (batch invariance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ringshm._C import ffi, lib
from ringshm.errors import KVRangeError, check_status


def f32_ptr(t: torch.Tensor):
    return ffi.cast("float *", t.data_ptr())


def _c_path(*ts: torch.Tensor) -> bool:
    """The one dispatch rule: every tensor on CPU in fp32 runs the C kernel (contiguity is checked by callers)."""
    for t in ts:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return True


def _same_placement(what: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise ValueError(f"{what}: {name} is {t.dtype}, expected {ref.dtype} like the others")
        if t.device != ref.device:
            raise ValueError(f"{what}: {name} is on {t.device}, expected {ref.device} like the others")


def _need_contiguous(what: str, **ts: torch.Tensor) -> None:
    for name, t in ts.items():
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")


# --- RoPE -------------------------------------------------------------------------------------------------------


def rope_tables(head_dim: int, max_seq_len: int, theta: float = 10000.0, device="cpu",
                inv_freq: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE angle tables for positions ``0 .. max_seq_len - 1``.

    Returns ``(cos, sin)``, each fp32 ``[max_seq_len, head_dim // 2]``: entry ``[p, i]`` is ``cos/sin(p * f_i)``
    (times ``scale`` when it is not 1: YaRN's attention factor, ``ringshm.model.rope.rope_scale``) with ``f_i`` =
    ``inv_freq[i]`` (``ringshm.model.rope``: scalings, Gemma's local base), by default
    ``1 / theta ** (2i / head_dim)`` (RoFormer, Su et al. 2021). Computed exactly as transformers' rotary
    embeddings do in fp32, so the angles match its bits: one fp32 product ``p * f_i`` per entry, then one product
    by ``scale``.

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
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.contiguous().to(device), sin.contiguous().to(device)


def check_rope_tables(what: str, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, device) -> None:
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim // 2:
        raise ValueError(
            f"{what}: cos and sin must both be [max_seq_len, {head_dim // 2}] "
            f"(from rope_tables(head_dim={head_dim}, ...)),"
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
        check_rope_tables("apply_rope", cos, sin, d, x.device)  # raises with the details, or passes a torch-path call
    if start + n > cos.shape[0]:
        raise KVRangeError(f"apply_rope: positions up to {start + n - 1} but the RoPE tables cover only "
                           f"{cos.shape[0]}; build them with a larger max_seq_len")
    if not _c_path(x) or n == 0:
        return apply_rope_reference(x, start, cos, sin)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty((n, h, d), dtype=torch.float32)
    status = lib.ringshm_rope_apply(f32_ptr(out), f32_ptr(x), f32_ptr(cos), f32_ptr(sin), n, h, d, start, cos.shape[0])
    if status:
        check_status(status, "apply_rope")
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
    weight = weight.contiguous()
    check_status(lib.ringshm_rms_norm(f32_ptr(out), f32_ptr(x), f32_ptr(weight), weight.numel(), x.shape[0],
                                      x.shape[1], eps), "rms_norm")
    return out


def act_mul(gate_up: torch.Tensor, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The MLP's gate: ``act(gate) * up`` for fp32 CPU ``gate_up [T, 2I]`` (rows ``[gate | up]``) → ``[T, I]``.

    ``activation``: "silu" (SwiGLU, Llama), "gelu_tanh" (GeGLU, Gemma: transformers' gelu_pytorch_tanh) or
    "swiglu_oai" (gpt-oss: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``).
    Each element by the same vector code (csrc/kernels.h), so its bits depend only on its two inputs.

    Raises:
        ValueError: not a 2-D fp32 CPU tensor with an even, positive number of columns; another activation; alpha
            or limit not finite > 0.
    """
    if gate_up.dim() != 2 or gate_up.dtype is not torch.float32 or not gate_up.is_cpu or gate_up.shape[1] % 2 \
            or gate_up.shape[1] == 0 or gate_up.shape[0] < 1:
        raise ValueError(f"act_mul takes fp32 CPU [T ≥ 1, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    fn = {"silu": lib.ringshm_silu_mul, "gelu_tanh": lib.ringshm_gelu_tanh_mul,
          "swiglu_oai": lambda *a: lib.ringshm_swiglu_oai_mul(*a, alpha, limit)}.get(activation)
    if fn is None:
        raise ValueError(f"act_mul: activation {activation!r} is not silu, gelu_tanh or swiglu_oai")
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], inter), dtype=torch.float32)
    check_status(fn(f32_ptr(out), f32_ptr(gate_up), gate_up.shape[0], inter), "act_mul")
    return out


def act_mul_reference(gate_up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """Torch form of ``act_mul`` (any dtype and device): ``silu`` or tanh-``gelu`` of the gate times up, or gpt-oss's
    clamped SwiGLU in transformers' order (``GptOssExperts._apply_gate`` on de-interleaved halves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "swiglu_oai":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return act * up
