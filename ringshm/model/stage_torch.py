"""The torch path's layer loop (``StageModel`` on a GPU, in bf16, or where csrc/layer.c refuses the shape): one
decoder layer as ``ringshm.model_config.ModelConfig`` describes it, in torch ops, the same function csrc/layer.h
computes on the native path (``StageModel._native_layers``). A mixin of ``ringshm.model.stage_model.StageModel``: it
reads the stage's ``config``, ``dtype``, ``layers``, ``kv``, ``rope``, ``windows`` and its ``_rms_norm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ringshm.model import kernels
from ringshm.model.attention import attention, kv_append
from ringshm.model.layer import Layer

if TYPE_CHECKING:
    from ringshm.model.stage_model import StepPlan


class TorchPath:
    """The torch path's layer, routed experts, gate and attention of ``StageModel`` (module docstring)."""

    def _layer(self, layer: Layer, li: int, x: torch.Tensor, attend) -> torch.Tensor:
        """One decoder layer on ``x [T, hidden]`` (torch path), as ``ModelConfig`` describes it; ``attend(q, k, v)``
        maps ``[T, H*, D]`` to ``[T, Hq, D]``. The native path does the same in C (``_native_layers``,
        csrc/layer.h)."""
        cfg = self.config
        t = x.shape[0]
        qkv = F.linear(self._rms_norm(x, layer.attn_norm), layer.wqkv, layer.bqkv).float()
        q, k, v = qkv.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
        q = q.reshape(t, cfg.n_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.reshape(t, cfg.n_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, cfg.n_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        if layer.q_norm is not None and cfg.qk_norm_full:  # over the whole projection (OLMoE)
            q = self._rms_norm(q.reshape(t, -1), layer.q_norm).float().reshape(q.shape)
            k = self._rms_norm(k.reshape(t, -1), layer.k_norm).float().reshape(k.shape)
        elif layer.q_norm is not None:  # per head: each head's D values normalised on their own
            q, k = self._rms_norm(q, layer.q_norm).float(), self._rms_norm(k, layer.k_norm).float()
        a = attend(q, k, v).reshape(t, cfg.q_dim)  # [T, Hq*D]
        o = F.linear(a.to(self.dtype), layer.wo, layer.bo)  # [T, hidden]
        rs = cfg.residual_scale  # Granite's; 1 elsewhere (x 1.0 is exact: the other families' bits are unchanged)
        x = x + (self._rms_norm(o, layer.post_attn_norm) if layer.post_attn_norm is not None else o * rs)
        if layer.moe:
            return x + self._experts(layer, self._rms_norm(x, layer.ffn_norm)) * rs
        gate_up = F.linear(self._rms_norm(x, layer.ffn_norm), layer.w_gate_up, layer.b_gate_up)  # [T, 2I]
        m = F.linear(self._act(gate_up), layer.w_down, layer.b_down)
        return x + (self._rms_norm(m, layer.post_ffn_norm) if layer.post_ffn_norm is not None else m * rs)

    def _experts(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        """The routed experts' FFN on ``h [T, hidden]`` (torch path; ``ModelConfig``'s formula, transformers' eager
        order: experts ascending, each term added into zeros; a shared expert's (gated) output added last).
        Returns ``[T, hidden]``."""
        cfg = self.config
        logits = F.linear(h, layer.w_router, layer.b_router).float()  # [T, E]
        if cfg.expert_gating == "topk_softmax":  # Granite: the softmax over the k largest logits
            top, experts = torch.topk(logits, cfg.n_experts_used, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, experts = torch.topk(torch.softmax(logits, dim=-1), cfg.n_experts_used, dim=-1)  # [T, k]
        if cfg.expert_gating == "softmax_norm":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(h)
        for e in range(cfg.n_experts):
            tok, rank = torch.where(experts == e)
            if tok.numel():
                xs = h[tok]
                bg, bu, bd = (None if b is None else b[e] for b in (layer.b_exp_gate, layer.b_exp_up, layer.b_exp_down))
                y = F.linear(self._act(torch.cat([F.linear(xs, layer.exp_gate[e], bg), F.linear(
                    xs, layer.exp_up[e], bu)], dim=-1)), layer.exp_down[e], bd)
                out.index_add_(0, tok, y * weights[tok, rank, None].to(y.dtype))
        if layer.shared:  # Qwen2MoeSparseMoeBlock: sigmoid(h . w) * shared(h), added after the routed sum
            shared = F.linear(self._act(F.linear(h, layer.sh_gate_up)), layer.sh_down)
            if layer.sh_gate_inp is not None:
                shared = torch.sigmoid(h @ layer.sh_gate_inp)[:, None] * shared
            out = out + shared
        return out

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The config's gate on ``gate_up [T, 2 I]`` rows ``[gate | up]`` (torch path) → ``[T, I]``."""
        cfg = self.config
        return kernels.act_mul_reference(gate_up, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)

    def _attend_segments(self, li: int, q, k, v, op: StepPlan) -> torch.Tensor:
        """RoPE, KV-append and attention of every segment through its table (torch path): ``q [T, Hq, D]``,
        ``k, v [T, Hkv, D]`` → ``[T, Hq, D]``."""
        cos, sin = self.rope[li]
        out, o = [], 0
        for i, (_, start, n, _) in enumerate(op.table):
            blocks = op.tables[int(op.table_offs[i]):int(op.table_offs[i + 1])]
            kv_append(self.kv[li], blocks, k[o:o + n].contiguous(), v[o:o + n].contiguous(), start, cos, sin)
            qi = kernels.apply_rope(q[o:o + n].contiguous(), start, cos, sin)
            out.append(attention(qi, self.kv[li], blocks, start, self.windows[li], self.config.attention_scale,
                                 self.layers[li].sinks))
            o += n
        return torch.cat(out) if len(out) > 1 else out[0]
