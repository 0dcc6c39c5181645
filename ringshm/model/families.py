"""The supported families, as descriptions: what each one's checkpoint calls its tensors and settings, and the
``ModelConfig`` (``ringshm.model_config``) they mean. One layer loop (``ringshm.model.stage_model``, csrc/layer.c)
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
``ringshm.model.families_gguf``, an HF ``config.json`` by ``ringshm.model.families_hf``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringshm.errors import UnsupportedArchitecture
from ringshm.model_config import ModelConfig

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
# gpt-oss as OpenAI releases it (HF quantization_config quant_method "mxfp4"): each expert role as MXFP4 blocks,
# "<name>_blocks" uint8 [E, rows, K / 32, 16] (byte j: weight 2j in its low nibble, 2j + 1 in its high one) and
# "<name>_scales" uint8 [E, rows, K / 32] (E8M0), rows [out] not transposed, gate_up's rows gate 0, up 0, gate 1, ...
HF_MXFP4_SUFFIXES = ("_blocks", "_scales")
SHARED_EXPERT_FIELDS = ("w_shexp_gate", "w_shexp_up", "w_shexp_down")
GGUF_MERGED_GATE_UP_EXPS = "ffn_gate_up_exps.weight"  # newer converters: gate and up of every expert in one tensor
GGUF_MERGED_GATE_UP_EXPS_BIAS = "ffn_gate_up_exps.bias"  # and (gpt-oss) their biases, [E, 2 I] rows [gate | up]
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


def _f32(x: float) -> float:
    """``x`` rounded to fp32 (what a tensor of it holds)."""
    import struct

    return struct.unpack("f", struct.pack("f", x))[0]
