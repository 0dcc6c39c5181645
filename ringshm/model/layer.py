"""One decoder layer's weights as a stage holds them (``Layer``: fused, packed for the C matmul or dense), and the
C layer's face: its shape (``layer_shape``, csrc/layer.h), the weights bound for it (``Layer.bind``) and the scratch
one step op needs (``layer_scratch_bytes``). ``ringshm.model.stage_model`` runs the layers."""

from __future__ import annotations

import torch

from ringshm._C import ffi, lib
from ringshm.model.attention import KVPool
from ringshm.model.loader import LayerWeights
from ringshm.model.qmatmul import PackedExperts, PackedWeight, RawWeight, concat_rows
from ringshm.model_config import ModelConfig


class Layer:
    """One decoder layer's weights, fused for fewer matmuls: ``wqkv [q_dim + 2*kv_dim, hidden]`` (+ ``bqkv``),
    ``w_gate_up [2*intermediate, hidden]`` (+ its bias); rows stacked in the checkpoint's encoding (gate and up of two
    encodings: both in F32, as the loader holds them; native: packed from where each part's rows lie,
    ``PackedWeight``). Native
    Q, K, V of different encodings stay apart: ``wqkv`` is then Q alone and ``wk``, ``wv`` K and V (csrc/layer.h);
    fused, ``concat_rows`` would widen them to F32 (8x a Q4_K tensor's memory). The optional parts of the
    description (q/k norms, post norms, biases) are None where the model has none.

    ``native``: ``PackedWeight`` for the C matmul; else dequantized tensors of ``dtype`` on ``device``.
    """

    def __init__(self, w: LayerWeights, native: bool, dtype: torch.dtype, device: torch.device) -> None:
        bqkv = None if w.bq is None else torch.cat([w.bq, w.bk, w.bv], dim=0)
        b_gate_up = None if w.b_gate is None else torch.cat([w.b_gate, w.b_up], dim=0)
        self.moe = w.w_router is not None  # routed experts in place of the dense FFN
        self.wk = self.wv = None  # K and V apart from Q (native, encodings differ)
        self.w_router = self.exp_gate = self.exp_up = self.exp_down = None
        self.shared = w.w_shexp_gate is not None  # a shared expert beside the routed ones (Qwen2-MoE, Granite)
        self.sh_gate_up = self.sh_down = self.sh_gate_inp = None
        if native:
            def f32(t):
                return None if t is None else t.to("cpu", torch.float32).contiguous()

            self.attn_norm, self.ffn_norm = f32(w.attn_norm), f32(w.ffn_norm)
            self.q_norm, self.k_norm = f32(w.q_norm), f32(w.k_norm)
            self.sinks, self.b_router = f32(w.sinks), f32(w.b_router)  # gpt-oss; the experts' biases flat, E after
            self.b_exp_gate, self.b_exp_up, self.b_exp_down = (  # one another
                None if b is None else f32(b).reshape(-1) for b in (w.b_exp_gate, w.b_exp_up, w.b_exp_down))
            self.post_attn_norm, self.post_ffn_norm = f32(w.post_attn_norm), f32(w.post_ffn_norm)
            if len({w.wq.qtype, w.wk.qtype, w.wv.qtype}) > 1:
                self.wqkv, self.wk, self.wv = PackedWeight(w.wq), PackedWeight(w.wk), PackedWeight(w.wv)
                self.bqkv = f32(bqkv)
            else:
                self.wqkv = PackedWeight([w.wq, w.wk, w.wv], bqkv)  # the rows stacked where they lie
                self.bqkv = self.wqkv.bias
            self.wo = PackedWeight(w.wo, w.bo)
            if self.moe:
                self.w_gate_up = self.w_down = None
                self.w_router = PackedWeight(w.w_router)
                self.exp_gate, self.exp_up, self.exp_down = (PackedExperts(e) for e in (w.w_exp_gate, w.w_exp_up,
                                                                                        w.w_exp_down))
                if self.shared:
                    self.sh_gate_up = PackedWeight([w.w_shexp_gate, w.w_shexp_up])
                    self.sh_down = PackedWeight(w.w_shexp_down)
                    self.sh_gate_inp = f32(w.shexp_gate_inp)
            else:
                self.w_down = PackedWeight(w.w_down, w.b_down)
                self.w_gate_up = PackedWeight([w.w_gate, w.w_up], b_gate_up)
            return

        def dense(t):
            return None if t is None else (t.dequantize() if isinstance(t, RawWeight) else t).to(device, dtype)

        self.attn_norm, self.ffn_norm = dense(w.attn_norm), dense(w.ffn_norm)
        self.q_norm, self.k_norm = dense(w.q_norm), dense(w.k_norm)
        self.sinks, self.b_router = dense(w.sinks), dense(w.b_router)  # [n_heads]; [E]
        self.b_exp_gate, self.b_exp_up, self.b_exp_down = (dense(b) for b in (w.b_exp_gate, w.b_exp_up, w.b_exp_down))
        self.post_attn_norm, self.post_ffn_norm = dense(w.post_attn_norm), dense(w.post_ffn_norm)
        self.wqkv, self.bqkv = dense(concat_rows([w.wq, w.wk, w.wv])), dense(bqkv)
        self.wo, self.bo = dense(w.wo), dense(w.bo)
        self.w_gate_up = None if self.moe else dense(concat_rows([w.w_gate, w.w_up]))
        self.b_gate_up = dense(b_gate_up)
        self.w_down, self.b_down = dense(w.w_down), dense(w.b_down)
        if self.moe:  # [E, hidden]; [E, I_e, hidden] gate and up; [E, hidden, I_e] down
            self.w_router = dense(w.w_router)
            self.exp_gate, self.exp_up, self.exp_down = (torch.stack([dense(x) for x in e]) for e in (
                w.w_exp_gate, w.w_exp_up, w.w_exp_down))
            if self.shared:  # [2 S, hidden] rows [gate | up]; [hidden, S]; [hidden] or None
                self.sh_gate_up = dense(concat_rows([w.w_shexp_gate, w.w_shexp_up]))
                self.sh_down = dense(w.w_shexp_down)
                self.sh_gate_inp = dense(w.shexp_gate_inp)

    def bind(self, kv: KVPool, cos: torch.Tensor, sin: torch.Tensor, window: int):
        """The native layer as ``struct ringshm_layer_weights`` (csrc/layer.h) over its packed weights, this
        layer's KV pool, RoPE tables and window; the tensors stay owned here and by the model."""
        c = ffi.new("struct ringshm_layer_weights *")
        split = self.wk is not None
        parts = (("qkv", self.wqkv), ("o", self.wo))
        parts += (("router", self.w_router),) if self.moe else (("gate_up", self.w_gate_up), ("down", self.w_down))
        parts += (("sh_gate_up", self.sh_gate_up), ("sh_down", self.sh_down)) if self.shared else ()
        for field, pw in parts + ((("wk", self.wk), ("wv", self.wv)) if split else ()):
            setattr(c, f"type_{field}", pw.qtype)
            setattr(c, field, ffi.cast("uint8_t *", pw.packed.data_ptr()))
            setattr(c, f"{field}_bytes", pw.nbytes)
        if self.moe:  # E packed experts per role, one expert's bytes apart
            for field, pe in (("exp_gate", self.exp_gate), ("exp_up", self.exp_up), ("exp_down", self.exp_down)):
                setattr(c, f"type_{field}", pe.qtype)
                setattr(c, field, ffi.cast("uint8_t *", pe.packed.data_ptr()))
                setattr(c, f"{field}_bytes", pe.stride)

        c.qkv_split = int(split)
        dense_ffn = not self.moe
        for field, t in (("bqkv", self.bqkv), ("bo", self.wo.bias),
                         ("bgate_up", self.w_gate_up.bias if dense_ffn else None),
                         ("bdown", self.w_down.bias if dense_ffn else None), ("attn_norm", self.attn_norm),
                         ("ffn_norm", self.ffn_norm), ("q_norm", self.q_norm), ("k_norm", self.k_norm),
                         ("post_attn_norm", self.post_attn_norm), ("post_ffn_norm", self.post_ffn_norm),
                         ("sh_gate_inp", self.sh_gate_inp), ("sinks", self.sinks), ("router_bias", self.b_router),
                         ("exp_gate_bias", self.b_exp_gate), ("exp_up_bias", self.b_exp_up),
                         ("exp_down_bias", self.b_exp_down), ("cos", cos), ("sin", sin)):
            # the pointer and the elements behind it: the C layer reads no vector past its length (layer.h)
            setattr(c, field, ffi.NULL if t is None else ffi.cast("float *", t.data_ptr()))
            setattr(c, f"{field}_len", 0 if t is None else t.numel())
        c.window = window
        c.kv = kv.c[0]
        return c


def layer_shape(config: ModelConfig, max_seq_len: int, activations: str = "float32"):
    """The C layer's shape (``struct ringshm_layer_shape``, csrc/layer.h) of ``config``'s layers, RoPE tables of
    ``max_seq_len`` positions, its matmuls multiplying ``activations`` ("float32" or "int8":
    ``EngineConfig.matmul_activations``) (a cffi struct pointer)."""
    return ffi.new("struct ringshm_layer_shape *", dict(
        hidden=config.hidden, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
        inter=config.intermediate, n_pos=max_seq_len, rms_eps=config.rms_eps,
        attn_scale=config.attention_scale,
        act={"silu": lib.RINGSHM_ACT_SILU, "gelu_tanh": lib.RINGSHM_ACT_GELU_TANH,
             "swiglu_oai": lib.RINGSHM_ACT_SWIGLU_OAI}[config.activation],
        swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit,
        qk_norm_full=int(config.qk_norm_full), n_experts=config.n_experts,
        n_experts_used=config.n_experts_used, expert_inter=config.expert_intermediate,
        gating={"softmax": lib.RINGSHM_GATE_SOFTMAX, "softmax_norm": lib.RINGSHM_GATE_SOFTMAX_NORM,
                "topk_softmax": lib.RINGSHM_GATE_TOPK_SOFTMAX}[config.expert_gating],
        residual_scale=config.residual_scale, shared_inter=config.shared_expert_intermediate,
        shared_gate=int(config.shared_expert_gate), act_q8=int(activations == "int8")))


def layer_scratch_bytes(config: ModelConfig, tokens: int, activations: str = "float32") -> int:
    """Bytes of the C layers' scratch for a step op of ``tokens`` tokens (``ringshm_layer_work_floats``: the
    activations of one layer, and for a mixture of experts each (token, expert) pair's rows), fp32. One buffer
    per stage, shared by its layers; ``StageModel.reserve`` holds it from the start; "int8" ``activations`` add the
    quantized rows of a matmul's input)."""
    floats = int(lib.ringshm_layer_work_floats(layer_shape(config, 1, activations), max(1, tokens)))
    return 4 * floats if floats > 0 else 0  # < 0: a shape the C layers refuse (the stage runs torch: no scratch)
