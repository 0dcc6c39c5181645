"""The supported families, as descriptions: what each one's checkpoint calls its tensors and settings, and the
``ModelConfig`` (``ringshm.config``) they mean. One layer loop (``ringshm.model.stage_model``, csrc/layer.c)
reads the description; nothing here computes.

    family   HF model_type   GGUF arch   differs from Llama by
    llama    llama           llama       (Llama 2 / 3; Llama 3.1's RoPE scaling: rope_type llama3)
    mistral  mistral         llama*      a sliding window on every layer (when the config sets one)
    qwen2    qwen2           qwen2       q/k/v biases; NeoX-order q/k rows in GGUF
    qwen3    qwen3           qwen3       per-head RMSNorm on q and k
    gemma3   gemma3_text     gemma3      embedding x sqrt(hidden), (1 + w) RMSNorm (GGUF: stored already added),
                                         post norms, GeGLU (tanh-GELU), q/k norms, sliding layers with their
                                         own RoPE base, attention scale query_pre_attn_scalar^-1/2, logit cap
    phi3     phi3            phi3        fused qkv and gate_up tensors, a sliding window on every layer
    qwen3moe qwen3_moe       qwen3moe    Qwen 3's attention; every FFN a routed mixture of experts (top-k of a
                                         softmax, renormalised when norm_topk_prob: GGUF files always are)
    olmoe    olmoe           olmoe       routed experts, top-k of a softmax, not renormalised; q / k RMSNorm over
                                         the whole projection ([q_dim], [kv_dim]), not per head
    granitemoe granitemoe    granitemoe  routed experts, softmax over the top-k logits; muP multipliers on the
               granitemoeshared          embedding, attention scale, both residual branches and the logits;
                                         HF experts fused 3-D (input_linear [E, 2 I, hidden], output_linear);
                                         granitemoeshared: a shared expert, ungated (shared_mlp.input_linear
                                         [2 S, hidden] rows [gate | up], output_linear; GGUF ffn_*_shexp)
    mixtral  mixtral         llama**     Mistral's attention; every FFN routed experts, top-k of a softmax,
                                         renormalised; HF names block_sparse_moe.gate / experts.{e}.w1 w3 w2
    qwen2moe qwen2_moe       qwen2moe    Qwen 2's attention (q/k/v biases); routed experts, top-k of a softmax
                                         (renormalised when norm_topk_prob; GGUF: never), plus a shared expert
                                         whose output is gated by sigmoid(h . w) (Qwen1.5-MoE, Qwen2-57B-A14B)
    gptoss   gpt_oss         gpt-oss     q/k/v/o biases, a learned attention sink per head, sliding (128) and full
                                         layers alternating, YaRN (ramp not truncated); routed experts, softmax
                                         over the top-k logits, biased router and experts, the clamped SwiGLU
                                         (swiglu_oai); HF experts fused 3-D and transposed (gate_up_proj
                                         [E, hidden, 2 I], gate and up columns interleaved); GGUF experts MXFP4
    (* llama.cpp writes Mistral checkpoints as arch "llama"; ** a "llama" file with llama.expert_count is Mixtral)

A routed expert's weights: in GGUF one 3-D tensor per role and layer, ``ffn_{gate,up,down}_exps`` (``[E, rows,
cols]``, torch order; newer converters may merge gate and up into ``ffn_gate_up_exps`` ``[E, 2 I, hidden]``, rows
[gate | up]), the router ``ffn_gate_inp`` ``[E, hidden]``; in an HF directory one 2-D tensor per expert,
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (what ``save_pretrained`` writes and the released checkpoints
hold), the router ``mlp.gate.weight`` (Mixtral: ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1`` /
``w3`` / ``w2`` for gate / up / down). GGUF files older than llama.cpp's 3-D expert tensors (Mixtral's of early
2024) hold one 2-D tensor per expert, ``ffn_{gate,up,down}.{e}.weight``; both are read. Other MoE families are
refused by name with what they need (``UNSUPPORTED_MOE``).

**A setting that changes the math is computed or refused by name, never ignored.** Every field of an HF
``config.json`` is either read here, or listed in ``HARMLESS_HF_FIELDS`` (training-only, bookkeeping, or known to
give the same function), or refused (``UnsupportedArchitecture`` naming it). The same holds for every GGUF
metadata key under ``<arch>.`` (``HARMLESS_GGUF_KEYS``), and the loader refuses checkpoint tensors it would not
read (an unread bias is how ``mlp_bias`` once went unnoticed). A GGUF's metadata is read by
``ringshm.model.families_gguf``, an HF ``config.json`` here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringshm.config import ModelConfig
from ringshm.errors import InvalidCheckpoint, UnsupportedArchitecture
from ringshm.model.rope_settings import hf_rope

_refuse = UnsupportedArchitecture.setting  # "<where>: <field> = <value> is not supported (<why>)"

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "olmoe", "granitemoe", "mixtral",
            "qwen2moe", "gptoss")
HF_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3",
            "phi3": "phi3", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "granitemoe": "granitemoe", "mixtral": "mixtral",
            "qwen2_moe": "qwen2moe", "granitemoeshared": "granitemoe", "gpt_oss": "gptoss"}
GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
              "phi3": "phi3", "qwen3moe": "qwen3moe", "olmoe": "olmoe", "granitemoe": "granitemoe", "mixtral": "llama",
              "qwen2moe": "qwen2moe", "gptoss": "gpt-oss"}
MOE_FAMILIES = ("qwen3moe", "olmoe", "granitemoe", "mixtral", "qwen2moe", "gptoss")
SUPPORTED_MOE = ("qwen3moe / qwen3_moe, olmoe, granitemoe (and granitemoeshared), mixtral (GGUF arch llama with "
                 "experts), qwen2moe / qwen2_moe, gpt-oss / gpt_oss")
# MoE checkpoints ringshm does not compute, by HF model_type and GGUF arch, with what they would need.
UNSUPPORTED_MOE = {
    "qwen3_next": "linear-attention (Gated DeltaNet) layers and a shared expert",
    "qwen3next": "linear-attention (Gated DeltaNet) layers and a shared expert",
    "qwen3_5_moe": "linear-attention (Gated DeltaNet) layers and a shared expert",
    "qwen35moe": "linear-attention (Gated DeltaNet) layers and a shared expert",
    "deepseek_v2": "multi-head latent attention (MLA) and shared experts",
    "deepseek_v3": "multi-head latent attention (MLA) and shared experts",
    "deepseek2": "multi-head latent attention (MLA) and shared experts",
    "phimoe": "sparsemixer routing", "jetmoe": "mixture-of-attention heads", "dbrx": "clipped fused qkv",
}
# llama.cpp's converter reorders these arches' q/k rows (loader docstring; Granite's converter is a LlamaModel)
GGUF_PERMUTED_QK = {"llama", "mistral", "granitemoe", "mixtral"}

# Fields that never change what an inference computes: training-only (dropout, initialisation), bookkeeping,
# token ids (read elsewhere), and flags whose every value gives the same function (pretraining_tp: a sliced
# matmul in training; use_cache).
HARMLESS_HF_FIELDS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop",
    "bos_token_id", "eos_token_id", "pad_token_id", "pretraining_tp", "output_attentions", "output_hidden_states",
    "return_dict", "cache_implementation", "tie_word_embeddings", "max_position_embeddings", "vocab_size",
    "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder",
    "problem_type", "id2label", "label2id", "task_specific_params", "use_return_dict", "finetuning_task",
    "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id", "max_window_layers",
})


@dataclass(frozen=True)
class TensorNames:
    """Where one family keeps a layer's tensors: (GGUF name under ``blk.{i}.``, HF name under
    ``model.layers.{i}.``) per ``LayerWeights`` field; None where the family has no such tensor."""

    layer: dict
    fused_qkv: bool = False  # Phi-3: one attn_qkv / qkv_proj tensor [q + 2 kv, hidden]
    fused_gate_up: bool = False  # Phi-3: one ffn_up / gate_up_proj tensor [2 I, hidden], rows [gate | up]
    hf_fused_experts: bool = False  # Granite MoE: HF experts 3-D, gate and up in one [E, 2 I, hidden] (w_exp_gate's)
    hf_fused_shexp: bool = False  # Granite MoE Shared: HF shared gate and up in one [2 S, hidden] (w_shexp_gate's)
    hf_transposed_experts: bool = False  # gpt-oss: HF experts 3-D [E, in, out], gate | up columns interleaved


_LLAMA_LAYER = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
    "bo": ("attn_output.bias", "self_attn.o_proj.bias"),
    "b_gate": ("ffn_gate.bias", "mlp.gate_proj.bias"),
    "b_up": ("ffn_up.bias", "mlp.up_proj.bias"),
    "b_down": ("ffn_down.bias", "mlp.down_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
    # a routed MoE's FFN (n_experts > 0) in place of w_gate / w_up / w_down: the router [E, hidden] and, per
    # expert e, gate / up [expert_intermediate, hidden], down [hidden, expert_intermediate]. GGUF holds each role
    # as one 3-D tensor [E, rows, cols]; HF one tensor per expert ({e} in the name)
    "w_router": ("ffn_gate_inp.weight", "mlp.gate.weight"),
    "w_exp_gate": ("ffn_gate_exps.weight", "mlp.experts.{e}.gate_proj.weight"),
    "w_exp_up": ("ffn_up_exps.weight", "mlp.experts.{e}.up_proj.weight"),
    "w_exp_down": ("ffn_down_exps.weight", "mlp.experts.{e}.down_proj.weight"),
}
_GRANITEMOE_LAYER = {
    **_LLAMA_LAYER,
    "w_router": ("ffn_gate_inp.weight", "block_sparse_moe.router.layer.weight"),
    "w_exp_gate": ("ffn_gate_exps.weight", "block_sparse_moe.input_linear.weight"),  # HF: rows [gate | up]
    "w_exp_up": ("ffn_up_exps.weight", "block_sparse_moe.input_linear.weight"),
    "w_exp_down": ("ffn_down_exps.weight", "block_sparse_moe.output_linear.weight"),
    # Granite MoE Shared's shared expert (no gate): HF one [2 S, hidden] tensor, rows [gate | up]
    "w_shexp_gate": ("ffn_gate_shexp.weight", "shared_mlp.input_linear.weight"),
    "w_shexp_up": ("ffn_up_shexp.weight", "shared_mlp.input_linear.weight"),
    "w_shexp_down": ("ffn_down_shexp.weight", "shared_mlp.output_linear.weight"),
}
_MIXTRAL_LAYER = {
    **_LLAMA_LAYER,
    "w_router": ("ffn_gate_inp.weight", "block_sparse_moe.gate.weight"),
    "w_exp_gate": ("ffn_gate_exps.weight", "block_sparse_moe.experts.{e}.w1.weight"),
    "w_exp_up": ("ffn_up_exps.weight", "block_sparse_moe.experts.{e}.w3.weight"),
    "w_exp_down": ("ffn_down_exps.weight", "block_sparse_moe.experts.{e}.w2.weight"),
}
_QWEN2MOE_LAYER = {
    **_LLAMA_LAYER,
    # the shared expert: a dense FFN of its own width, and the [hidden] weights of its sigmoid gate
    "w_shexp_gate": ("ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"),
    "w_shexp_up": ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
    "w_shexp_down": ("ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"),
    "shexp_gate_inp": ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
}
_GPTOSS_LAYER = {
    **_LLAMA_LAYER,
    "ffn_norm": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "sinks": ("attn_sinks.weight", "self_attn.sinks"),  # [n_heads]
    "w_router": ("ffn_gate_inp.weight", "mlp.router.weight"),
    "b_router": ("ffn_gate_inp.bias", "mlp.router.bias"),  # [E]
    # HF: one [E, hidden, 2 I] tensor (x . W, columns gate 0, up 0, gate 1, ...), one [E, I, hidden]; biases
    # [E, 2 I] (interleaved alike) and [E, hidden]. GGUF (llama.cpp's converter splits and transposes them):
    # [E, I, hidden] gate and up, [E, hidden, I] down, biases [E, I] and [E, hidden]
    "w_exp_gate": ("ffn_gate_exps.weight", "mlp.experts.gate_up_proj"),
    "w_exp_up": ("ffn_up_exps.weight", "mlp.experts.gate_up_proj"),
    "w_exp_down": ("ffn_down_exps.weight", "mlp.experts.down_proj"),
    "b_exp_gate": ("ffn_gate_exps.bias", "mlp.experts.gate_up_proj_bias"),
    "b_exp_up": ("ffn_up_exps.bias", "mlp.experts.gate_up_proj_bias"),
    "b_exp_down": ("ffn_down_exps.bias", "mlp.experts.down_proj_bias"),
}
MOE_BIAS_FIELDS = ("b_router", "b_exp_gate", "b_exp_up", "b_exp_down")
SHARED_EXPERT_FIELDS = ("w_shexp_gate", "w_shexp_up", "w_shexp_down")
GGUF_MERGED_GATE_UP_EXPS = "ffn_gate_up_exps.weight"  # newer converters: gate and up of every expert in one tensor
EXPERT_FIELDS = ("w_exp_gate", "w_exp_up", "w_exp_down")
# GGUF files written before llama.cpp stacked experts (its Mixtral files of early 2024): one 2-D tensor per expert
GGUF_SPLIT_EXPERTS = {"w_exp_gate": "ffn_gate.{e}.weight", "w_exp_up": "ffn_up.{e}.weight",
                      "w_exp_down": "ffn_down.{e}.weight"}
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    # Gemma's names: HF post_attention_layernorm is the norm *after* attention; pre_feedforward the FFN's input
    "ffn_norm": ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
    "post_attn_norm": ("post_attention_norm.weight", "post_attention_layernorm.weight"),
    "post_ffn_norm": ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
}
_PHI3_LAYER = {
    **_LLAMA_LAYER,
    "wq": ("attn_qkv.weight", "self_attn.qkv_proj.weight"),  # fused: split by the loader
    "w_gate": ("ffn_up.weight", "mlp.gate_up_proj.weight"),  # fused: rows [gate | up]
}
TENSOR_NAMES = {
    "llama": TensorNames(_LLAMA_LAYER), "mistral": TensorNames(_LLAMA_LAYER), "qwen2": TensorNames(_LLAMA_LAYER),
    "qwen3": TensorNames(_LLAMA_LAYER), "gemma3": TensorNames(_GEMMA3_LAYER),
    "phi3": TensorNames(_PHI3_LAYER, fused_qkv=True, fused_gate_up=True),
    "qwen3moe": TensorNames(_LLAMA_LAYER), "olmoe": TensorNames(_LLAMA_LAYER),
    "granitemoe": TensorNames(_GRANITEMOE_LAYER, hf_fused_experts=True, hf_fused_shexp=True),
    "mixtral": TensorNames(_MIXTRAL_LAYER),
    "qwen2moe": TensorNames(_QWEN2MOE_LAYER),
    "gptoss": TensorNames(_GPTOSS_LAYER, hf_transposed_experts=True),
}
GLOBAL_TENSORS = {  # role -> (GGUF name, HF name)
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}


def wanted(cfg: ModelConfig, field: str, names: TensorNames) -> bool:
    """Whether layer tensor ``field`` (a ``LayerWeights`` field) belongs to ``cfg``'s description: the fused
    parts of Phi-3 are read as one, biases and q/k / post norms only where the config has them, the dense FFN or
    the router and experts (``cfg.moe``)."""
    if field in ("wk", "wv") and names.fused_qkv or field == "w_up" and names.fused_gate_up:
        return False
    if field in ("w_router", *EXPERT_FIELDS):
        return cfg.moe
    if field in MOE_BIAS_FIELDS:
        return cfg.moe_bias
    if field == "sinks":
        return cfg.attention_sinks
    if field in SHARED_EXPERT_FIELDS:
        return cfg.shared_expert_intermediate > 0
    if field == "shexp_gate_inp":
        return cfg.shared_expert_gate
    if field in ("w_gate", "w_up", "w_down") and cfg.moe:
        return False
    if field in ("bq", "bk", "bv"):
        return cfg.attention_bias
    if field == "bo":
        return cfg.o_bias
    if field in ("b_gate", "b_up", "b_down"):
        return cfg.mlp_bias and not cfg.moe and not (names.fused_gate_up and field == "b_up")
    if field in ("q_norm", "k_norm"):
        return cfg.qk_norm
    if field in ("post_attn_norm", "post_ffn_norm"):
        return cfg.post_norms
    return True


def unsupported_family(where: str, what: str, name, supported: str) -> UnsupportedArchitecture:
    """The refusal of an architecture ringshm does not describe (``what``: "model_type" or "GGUF architecture"),
    saying what an MoE family among them would need (``UNSUPPORTED_MOE``), else what is supported."""
    if name in UNSUPPORTED_MOE:
        return UnsupportedArchitecture(f"{where}: {what} {name!r} is a mixture-of-experts family ringshm does not "
                                       f"compute: it needs {UNSUPPORTED_MOE[name]} (supported MoE: {SUPPORTED_MOE})")
    return UnsupportedArchitecture(f"{where}: {what} {name!r} is not supported (supported: {supported})")


# ------------------------------------------------------------------------------------------ HF config.json
def hf_config(c: dict, where: str) -> ModelConfig:
    """The ``ModelConfig`` an HF ``config.json`` (already parsed) describes; ``where`` names it in errors.

    Reads both transformers 4 (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``) and 5
    (``rope_parameters``, per layer type for Gemma 3) spellings.

    Raises:
        UnsupportedArchitecture: another model_type, a field no family reads and not known to be harmless, or a
            value ringshm does not compute (each named with the field).
    """
    model_type = c.get("model_type")
    family = HF_TYPES.get(model_type)
    if family is None or model_type in UNSUPPORTED_MOE:
        raise unsupported_family(where, "model_type", model_type, ", ".join(HF_TYPES))
    if c.get("quantization_config") is not None:  # e.g. openai/gpt-oss-20b's MXFP4 experts as _blocks / _scales
        method = (c["quantization_config"] or {}).get("quant_method") if isinstance(c["quantization_config"], dict) \
            else c["quantization_config"]
        raise _refuse(where, "quantization_config", method, "a quantized HF checkpoint's tensors are not read: use a "
                      "GGUF of it (llama.cpp's convert_hf_to_gguf.py writes gpt-oss's MXFP4 experts as they are)")
    used: set[str] = set()

    def get(key: str, default=None):
        used.add(key)
        return c.get(key, default)

    n_heads = int(get("num_attention_heads"))
    hidden = int(get("hidden_size"))
    n_layers = int(get("num_hidden_layers"))
    head_dim = int(get("head_dim") or hidden // n_heads)
    eos = get("eos_token_id")
    act = get("hidden_activation") if family == "gemma3" else get("hidden_act", "silu")
    if family == "gemma3":
        used.add("hidden_act")  # Gemma 3 reads hidden_activation; hidden_act, if present, is ignored by it too
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}.get(act)
    if activation is None or (family != "gemma3" and activation != "silu"):
        raise _refuse(where, "hidden_act" if family != "gemma3" else "hidden_activation", act)
    kw = dict(arch=family, n_layers=n_layers, hidden=hidden, n_heads=n_heads,
              n_kv_heads=int(get("num_key_value_heads") or n_heads), head_dim=head_dim,
              intermediate=int(get("intermediate_size")), vocab=int(get("vocab_size")),
              rms_eps=float(get("rms_norm_eps", 1e-6)), tie_embeddings=bool(get("tie_word_embeddings", False)),
              max_seq_len=int(get("max_position_embeddings", 2048)),
              bos_token_id=None if get("bos_token_id") is None else int(c["bos_token_id"]),
              eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
              activation=activation)
    kw.update(hf_rope(c, family, used, where))
    kw.update(_hf_biases(c, family, used, where))
    kw.update(_hf_windows(c, family, n_layers, used, where))
    if family in ("qwen3", "gemma3", "qwen3moe", "olmoe"):
        kw["qk_norm"] = True
    if family in MOE_FAMILIES:
        kw.update(_hf_experts(c, family, used, where))
    if family == "gptoss":  # GptOssAttention / GptOssExperts: sinks, biased router and experts, the clamped SwiGLU
        used.update(("swiglu_alpha", "swiglu_limit"))
        kw.update(activation="swiglu_oai", attention_sinks=True, moe_bias=True,
                  swiglu_alpha=float(c.get("swiglu_alpha", 1.702)), swiglu_limit=float(c.get("swiglu_limit", 7.0)))
    if family == "granitemoe":  # muP: transformers' GraniteMoe* modules
        used.update(("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"))
        def mult(key: str) -> float:
            return 1.0 if c.get(key) is None else float(c[key])

        kw.update(embed_scale=mult("embedding_multiplier"), attn_scale=mult("attention_multiplier"),
                  residual_scale=mult("residual_multiplier"), logit_scale=mult("logits_scaling"))
    if family == "gemma3":
        if get("use_bidirectional_attention"):
            raise _refuse(where, "use_bidirectional_attention", True, "an embedding model, not a decoder")
        if get("attn_logit_softcapping") is not None:
            raise _refuse(where, "attn_logit_softcapping", c["attn_logit_softcapping"])
        kw.update(post_norms=True, norm_offset=1.0, embed_scale=float(_f32(math.sqrt(hidden))),
                  attn_scale=float(get("query_pre_attn_scalar", 256)) ** -0.5,
                  logit_softcap=float(get("final_logit_softcapping") or 0.0))
    if family == "phi3":
        if float(get("partial_rotary_factor", 1.0)) != 1.0:
            raise _refuse(where, "partial_rotary_factor", c["partial_rotary_factor"], "RoPE on every dimension only")
    unknown = sorted(k for k in c if k not in used and k not in HARMLESS_HF_FIELDS)
    if unknown:
        raise UnsupportedArchitecture(f"{where}: field(s) {', '.join(unknown)} of a {model_type} config are not "
                                      f"read by ringshm and may change the math: refusing rather than ignoring them")
    return ModelConfig(**kw)


def _hf_experts(c: dict, family: str, used: set, where: str) -> dict:
    """The routed-expert fields of a Qwen3-MoE / OLMoE / Granite MoE / Mixtral ``config.json``; refuses what is not
    computed, by name. Mixtral always renormalises its top-k (``MixtralTopKRouter``: softmax over every expert,
    top-k, divided by their sum) and reads no ``norm_topk_prob``; its ``router_jitter_noise`` multiplies the input
    by noise in training only (``MixtralSparseMoeBlock.forward``), so any value gives the same inference."""
    used.update(("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                 "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits", "clip_qkv",
                 "router_jitter_noise"))
    counts = {k: c[k] for k in ("num_experts", "num_local_experts") if c.get(k) is not None}  # transformers' alias
    if len(set(counts.values())) > 1:
        raise InvalidCheckpoint(f"{where}: num_experts = {counts['num_experts']} but num_local_experts = "
                                f"{counts['num_local_experts']}: one count of experts")
    if not counts:
        raise InvalidCheckpoint(f"{where}: num_experts (or num_local_experts) is missing: a {family} config must say "
                                f"how many routed experts a layer has")
    n_experts = next(iter(counts.values()))
    inter_key = "moe_intermediate_size" if family in ("qwen3moe", "qwen2moe") else "intermediate_size"
    for key in ("num_experts_per_tok", inter_key):
        if c.get(key) is None:
            raise InvalidCheckpoint(f"{where}: {key} is missing: a {family} config must say it")
    if c["num_experts_per_tok"] > n_experts:
        raise InvalidCheckpoint(f"{where}: num_experts_per_tok = {c['num_experts_per_tok']} is more than the "
                                f"{n_experts} experts a layer has")
    if c.get("mlp_only_layers"):
        raise _refuse(where, "mlp_only_layers", c["mlp_only_layers"], "every layer routed only")
    if c.get("decoder_sparse_step") not in (None, 1):
        raise _refuse(where, "decoder_sparse_step", c["decoder_sparse_step"], "every layer routed only")
    if c.get("clip_qkv") is not None:
        raise _refuse(where, "clip_qkv", c["clip_qkv"])
    gating = "topk_softmax" if family in ("granitemoe", "gptoss") else "softmax_norm" if c.get("norm_topk_prob") or \
        family == "mixtral" else "softmax"
    out = dict(n_experts=int(n_experts), n_experts_used=int(c["num_experts_per_tok"]),
               expert_intermediate=int(c[inter_key]), expert_gating=gating)
    if family == "olmoe":  # q / k norms over the whole projection (OlmoeAttention's q_norm [hidden])
        out["qk_norm_full"] = True
    used.add("shared_expert_intermediate_size")
    if c.get("model_type") == "granitemoeshared":  # GraniteMoeSharedDecoderLayer: moe(h) + shared_mlp(h), no gate
        used.add("shared_intermediate_size")
        if c.get("shared_intermediate_size"):  # 0: no shared_mlp (transformers builds none)
            out.update(shared_expert_intermediate=int(c["shared_intermediate_size"]))
    if family == "qwen2moe":  # Qwen2MoeSparseMoeBlock: the shared expert always, gated by sigmoid(h . w)
        if not c.get("shared_expert_intermediate_size"):
            raise InvalidCheckpoint(f"{where}: shared_expert_intermediate_size = "
                                    f"{c.get('shared_expert_intermediate_size')!r}: a qwen2_moe config must say how "
                                    f"wide its shared expert is (> 0)")
        out.update(shared_expert_intermediate=int(c["shared_expert_intermediate_size"]), shared_expert_gate=True)
    elif c.get("shared_expert_intermediate_size"):
        raise _refuse(where, "shared_expert_intermediate_size", c["shared_expert_intermediate_size"],
                      f"{family} has no shared expert")
    return out


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (what a tensor of it holds)."""
    import struct

    return struct.unpack("f", struct.pack("f", x))[0]


def _hf_biases(c: dict, family: str, used: set, where: str) -> dict:
    used.update(("attention_bias", "mlp_bias", "qkv_bias"))
    if family == "qwen2":  # Qwen 2: q/k/v biases always, no output bias
        return dict(attention_bias=True)
    if family == "qwen2moe":  # Qwen2-MoE: q/k/v biases unless qkv_bias is false (transformers 5), no output bias
        return dict(attention_bias=bool(c.get("qkv_bias", True)))
    if family == "mixtral":  # MixtralAttention and its experts: no bias whatever attention_bias / mlp_bias say
        return {}
    if family == "gptoss":  # GptOssAttention: q/k/v/o biases unless attention_bias is false (GptOssConfig: true)
        attn_bias = bool(c.get("attention_bias", True))
        return dict(attention_bias=attn_bias, o_bias=attn_bias)
    attn_bias = bool(c.get("attention_bias", False))
    if attn_bias and family in ("gemma3", "phi3", "qwen3", "mistral"):
        # these families' attention_bias covers q/k/v and o, as Llama's (transformers' modeling files)
        pass
    return dict(attention_bias=attn_bias, o_bias=attn_bias, mlp_bias=bool(c.get("mlp_bias", False)))


def _hf_windows(c: dict, family: str, n_layers: int, used: set, where: str) -> dict:
    used.update(("sliding_window", "layer_types", "use_sliding_window", "sliding_window_pattern",
                 "_sliding_window_pattern"))
    window = c.get("sliding_window")
    layer_types = c.get("layer_types")
    if family in ("qwen2", "qwen3", "qwen3moe", "qwen2moe"):
        if c.get("use_sliding_window"):
            raise _refuse(where, "use_sliding_window", True, "Qwen's per-layer sliding windows are not computed")
        if layer_types is not None and set(layer_types) - {"full_attention"}:
            raise _refuse(where, "layer_types", layer_types, "Qwen's per-layer sliding windows are not computed")
        return {}
    if family in ("gemma3", "gptoss"):
        if layer_types is None:  # Gemma 3: every 6th layer full; gpt-oss: every 2nd (GptOssConfig.__post_init__)
            pattern = int(c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or (
                6 if family == "gemma3" else 2))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        if len(layer_types) != n_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
            raise _refuse(where, "layer_types", layer_types)
        sliding = tuple(t == "sliding_attention" for t in layer_types)
        if any(sliding) and not window:
            raise _refuse(where, "sliding_window", window, "sliding layers need a window")
        return dict(sliding_window=int(window or 0), sliding_layers=sliding if any(sliding) else ())
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise _refuse(where, "layer_types", layer_types, f"{family} slides on every layer or none")
    return dict(sliding_window=int(window or 0))
