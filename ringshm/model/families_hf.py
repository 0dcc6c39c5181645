"""The Hugging Face side of the family descriptions (``ringshm.model.families``): the ``ModelConfig`` an HF
``config.json`` describes, as transformers' modeling files read it. Every field is read here, listed in
``families.HARMLESS_HF_FIELDS``, or refused by name.
"""

from __future__ import annotations

import math

from ringshm.errors import InvalidCheckpoint, UnsupportedArchitecture
from ringshm.model.families import (HARMLESS_HF_FIELDS, HF_TYPES, MOE_FAMILIES, UNSUPPORTED_MOE, _f32, _refuse,
                                    unsupported_family)
from ringshm.model.rope_settings import hf_rope
from ringshm.model_config import ModelConfig


# What transformers' config classes take for a field a config.json leaves out, where it differs from the default
# hf_config reads otherwise (rms_norm_eps 1e-6, rope_theta 10000, no window): each family's class defaults (their
# ``default_theta``, ``__init__`` / ``__post_init__``), checked against transformers by tests/test_families.py.
HF_DEFAULTS = {
    "phi3": {"rms_norm_eps": 1e-5},
    "olmoe": {"rms_norm_eps": 1e-5},
    "mixtral": {"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "mistral": {"sliding_window": 4096},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096},
    "gpt_oss": {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "sliding_window": 128},
}
# GptOssConfig.__post_init__'s RoPE when the config gives none (its rope_theta joins it, default 150000)
GPTOSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
               "original_max_position_embeddings": 4096}
# fields of OpenAI's gpt-oss config.json that transformers' GptOss modules never read
GPTOSS_HARMLESS = frozenset({"experts_per_token", "initial_context_length"})


def hf_mxfp4(c: dict) -> bool:
    """Whether an HF ``config.json`` (``c``) says its experts are MXFP4 blocks (``quantization_config`` of
    ``quant_method`` "mxfp4", as OpenAI releases gpt-oss: the experts' ``_blocks`` / ``_scales``, every other tensor
    in its float type, which the tensor check holds it to)."""
    quant = c.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "mxfp4"


# what transformers' Mxfp4Config carries besides quant_method, none of which changes what ringshm computes from the
# tensors: modules left in floats (checked: never the experts) and whether transformers dequantizes at load
MXFP4_CONFIG_KEYS = frozenset({"quant_method", "modules_to_not_convert", "dequantize"})


def _check_mxfp4(c: dict, where: str) -> None:
    """An MXFP4 ``quantization_config`` ringshm reads as transformers does, or a refusal naming what it cannot:
    another key, experts among ``modules_to_not_convert`` (transformers would then ignore their blocks), and a
    ``swiglu_alpha`` other than 1.702 (transformers' MXFP4 experts fix alpha at 1.702 and ignore the field, its
    dequantized path reads it: the two disagree)."""
    quant = c["quantization_config"]
    extra = sorted(set(quant) - MXFP4_CONFIG_KEYS)
    if extra:
        raise _refuse(where, f"quantization_config.{extra[0]}", quant[extra[0]], "an MXFP4 setting ringshm does not "
                      "read")
    keep = quant.get("modules_to_not_convert") or []
    if not isinstance(keep, list) or any(not isinstance(m, str) or "experts" in m for m in keep):
        raise _refuse(where, "quantization_config.modules_to_not_convert", keep,
                      "the experts are read from their MXFP4 blocks")
    if c.get("swiglu_alpha", 1.702) != 1.702:
        raise _refuse(where, "swiglu_alpha", c["swiglu_alpha"], "transformers' MXFP4 experts use 1.702 whatever it "
                      "says, its dequantized ones the field: the two disagree")


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
    quant = c.get("quantization_config")
    if quant is not None and not (family == "gptoss" and hf_mxfp4(c)):  # other HF quantizations: not read
        field, value = ("quantization_config.quant_method", quant.get("quant_method")) if isinstance(quant, dict) \
            else ("quantization_config", quant)
        raise _refuse(where, field, value, "a quantized HF checkpoint's tensors are not read (but gpt-oss's MXFP4 "
                      "experts): use a GGUF of it")
    if quant is not None:
        _check_mxfp4(c, where)
    c = {**HF_DEFAULTS.get(model_type, {}), **c}  # a field left out means the config class's default
    if family == "gptoss" and c.get("rope_parameters") is None and c.get("rope_scaling") is None:
        c["rope_parameters"] = {**GPTOSS_ROPE, "rope_theta": c["rope_theta"]}
    used: set[str] = set(GPTOSS_HARMLESS) | {"quantization_config"} if family == "gptoss" else set()

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
        if layer_types is None:  # Gemma 3: every 6th layer full, or its pattern; gpt-oss: every 2nd whatever any
            pattern = 2 if family == "gptoss" else int(  # pattern key says (GptOssConfig.__post_init__ reads none)
                c.get("sliding_window_pattern") or c.get("_sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers or \
                set(layer_types) - {"sliding_attention", "full_attention"}:
            raise _refuse(where, "layer_types", layer_types, f"one of 'sliding_attention' / 'full_attention' per "
                                                             f"layer: {n_layers} layers")
        sliding = tuple(t == "sliding_attention" for t in layer_types)
        if any(sliding) and not window:
            raise _refuse(where, "sliding_window", window, "sliding layers need a window")
        return dict(sliding_window=int(window or 0), sliding_layers=sliding if any(sliding) else ())
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise _refuse(where, "layer_types", layer_types, f"{family} slides on every layer or none")
    return dict(sliding_window=int(window or 0))
