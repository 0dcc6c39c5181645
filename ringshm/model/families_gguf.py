"""The GGUF side of the family descriptions (``ringshm.model.families``): the ``ModelConfig`` a GGUF file's
``<arch>.*`` metadata and tensor names describe, as llama.cpp reads them. Every key under ``<arch>.`` is read here
or listed in ``HARMLESS_GGUF_KEYS``; any other is refused by name.
"""

from __future__ import annotations

import dataclasses
import math

from ringshm.errors import InvalidCheckpoint, UnsupportedArchitecture
from ringshm.model.families import MOE_FAMILIES, SUPPORTED_MOE, UNSUPPORTED_MOE, _f32, _refuse, unsupported_family
from ringshm.model.rope_settings import YARN_GGUF_KEYS, gguf_rope
from ringshm.model_config import ModelConfig

HARMLESS_GGUF_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "vocab_size", "rope.scaling.type", "rope.scaling.factor",
    "rope.scaling.original_context_length", "attention.sliding_window", "final_logit_softcapping",
    "rope.scaling.finetuned", "expert_count", "expert_used_count", "expert_feed_forward_length",
})


# Whether an arch's layers carry q / k norms, as llama.cpp's (and transformers') models of it fix it; the other
# arches (llama, qwen2, phi3) have none and say so by their tensors (a norm there is refused as not read).
FIXED_QK_NORM = {"qwen3": True, "gemma3": True, "qwen3moe": True, "olmoe": True, "granitemoe": False,
                 "mixtral": False, "qwen2moe": False, "gptoss": False}
GRANITE_GGUF_KEYS = frozenset({"embedding_scale", "residual_scale", "attention.scale", "logit_scale"})


def gguf_config(meta: dict, tensor_names: set[str], arch: str, where: str, vocab: int, rope_freqs) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file's metadata (``meta``: key -> value), tensor names and arch.

    ``rope_freqs``: the values of ``rope_freqs.weight`` (llama.cpp's Llama 3 per-frequency factors) or None.

    Raises:
        UnsupportedArchitecture: another arch, an ``<arch>.*`` key not read here and not known to be harmless, or a
            value ringshm does not compute (each named). InvalidCheckpoint: a key the family needs is missing, or
            values that contradict each other.
    """
    family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3",
              "qwen3moe": "qwen3moe", "olmoe": "olmoe", "granitemoe": "granitemoe", "qwen2moe": "qwen2moe",
              "gpt-oss": "gptoss"}.get(arch)
    if arch == "llama" and "llama.expert_count" in meta:
        family = "mixtral"  # llama.cpp's Mixtral: arch llama whose hparams count experts (LLM_ARCH_LLAMA, n_expert > 0)
    if family is None or arch in UNSUPPORTED_MOE:
        raise unsupported_family(where, "GGUF architecture", arch, "llama (and Mixtral: llama with experts), qwen2, "
                                 "qwen3, gemma3, phi3, qwen3moe, olmoe, granitemoe, qwen2moe, gpt-oss")

    def need(key: str):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise InvalidCheckpoint(f"{where}: GGUF metadata key '{arch}.{key}' is missing: a {arch} file must say it")
        return value

    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    n_layers = int(need("block_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise _refuse(where, f"{arch}.attention.value_length", meta.get(f"{arch}.attention.value_length"),
                      "value heads as wide as key heads only")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise _refuse(where, f"{arch}.rope.dimension_count", rope_dims, "RoPE on every dimension only")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    kw = dict(arch=family, n_layers=n_layers, hidden=hidden, n_heads=n_heads,
              n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)), head_dim=head_dim,
              intermediate=int(need("feed_forward_length")), vocab=vocab,
              rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
              rms_eps=float(need("attention.layer_norm_rms_epsilon")),
              tie_embeddings="output.weight" not in tensor_names, max_seq_len=int(need("context_length")),
              bos_token_id=None if meta.get("tokenizer.ggml.bos_token_id") is None else int(meta.get(
                  "tokenizer.ggml.bos_token_id")),
              eos_token_ids=() if eos is None else (int(eos),),
              attention_bias="blk.0.attn_q.bias" in tensor_names, o_bias="blk.0.attn_output.bias" in tensor_names,
              mlp_bias="blk.0.ffn_down.bias" in tensor_names, qk_norm="blk.0.attn_q_norm.weight" in tensor_names)
    if family in FIXED_QK_NORM:  # the arch fixes these: a file that lacks or adds them is refused by its tensors
        kw.update(qk_norm=FIXED_QK_NORM[family])
    if family in MOE_FAMILIES and family not in ("qwen2moe", "gptoss"):  # llama.cpp's MoE arches read no
        kw.update(attention_bias=False, o_bias=False)  # attention biases but qwen2moe's q/k/v and gpt-oss's q/k/v/o
    if family == "gptoss":  # llama.cpp's gpt-oss (LLM_ARCH_OPENAI_MOE): every one required, sinks, the clamped
        kw.update(attention_bias=True, o_bias=True, attention_sinks=True, moe_bias=True,  # SwiGLU of alpha 1.702,
                  activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)  # limit 7 (build_moe_ffn)
    if family == "qwen2moe":
        kw.update(o_bias=False)
    if family in MOE_FAMILIES:
        kw.update(_gguf_experts(meta, tensor_names, arch, family, where, need))
    elif f"{arch}.expert_count" in meta or any(".ffn_gate_inp." in n for n in tensor_names):
        what = next((f"tensor {n!r}" for n in sorted(tensor_names) if ".ffn_gate_inp." in n),
                    f"key {arch}.expert_count")
        hint = " (a Mixtral file says llama.expert_count, and this one does not)" if arch == "llama" else ""
        raise UnsupportedArchitecture(f"{where}: {what}: routed experts in a {arch} file are not read by ringshm's "
                                      f"{arch} description{hint} (it computes experts for {SUPPORTED_MOE})")
    if family == "granitemoe":  # llama.cpp's granite hparams: f_embedding_scale, f_residual_scale, ...
        kw.update(embed_scale=float(meta.get(f"{arch}.embedding_scale", 1.0)),
                  attn_scale=float(meta.get(f"{arch}.attention.scale", 1.0)),
                  residual_scale=float(meta.get(f"{arch}.residual_scale", 1.0)),
                  logit_scale=float(meta.get(f"{arch}.logit_scale", 1.0)))
    kw.update(gguf_rope(meta, arch, where, need, rope_freqs))
    if family == "gptoss" and kw.get("rope_scaling") is not None and kw["rope_scaling"].kind == "yarn":
        # gpt-oss's YaRN ramp is not truncated (OpenAI's reference and transformers' "truncate": false); llama.cpp
        # floors / ceils every arch's ramp ends: the model's own definition is taken here
        kw["rope_scaling"] = dataclasses.replace(kw["rope_scaling"], truncate=False)
    window = meta.get(f"{arch}.attention.sliding_window")
    pattern_key, swa_base_key = f"{arch}.attention.sliding_window_pattern", f"{arch}.rope.freq_base_swa"
    swa_base = meta.get(swa_base_key)
    if family in ("gemma3", "gptoss"):
        # llama.cpp's set_swa_pattern: every n-th layer global (Gemma 3 6, gpt-oss 2: layers 0, 2, 4, ... slide),
        # unless the file's pattern key says otherwise (a period, or one flag per layer)
        pattern = meta.get(pattern_key, 6 if family == "gemma3" else 2)
        if isinstance(pattern, (list, tuple)):
            sliding = tuple(bool(x) for x in pattern)
        else:
            sliding = tuple(bool((i + 1) % int(pattern)) for i in range(n_layers))
    elif pattern_key in meta:
        raise _refuse(where, pattern_key, meta[pattern_key], f"{arch} layers have no sliding-window pattern")
    if swa_base is not None and family != "gemma3" and float(swa_base) != float(meta.get(f"{arch}.rope.freq_base",
                                                                                         10_000.0)):
        raise _refuse(where, swa_base_key, swa_base,
                      "a RoPE base of the sliding layers other than rope.freq_base is computed for Gemma 3 only")
    if family == "gemma3":
        kw.update(post_norms=True, activation="gelu_tanh", embed_scale=float(_f32(math.sqrt(hidden))),
                  sliding_window=int(window or 0), sliding_layers=sliding if window else (),
                  # the local layers' base: today's converter writes it; older files (the 270M one) do not, and
                  # llama.cpp then takes 10000
                  rope_local_theta=float(swa_base or 10_000.0),
                  attn_scale=1.0 / math.sqrt(head_dim),  # llama.cpp: 1/sqrt(key_length) below 27B
                  logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping") or 0.0))
        if kw["attention_bias"] or kw["o_bias"] or kw["mlp_bias"]:
            raise _refuse(where, "biases", "present", "Gemma 3 has none")
    elif family == "gptoss":  # transformers' layer_types alike: sliding, full, sliding, ...
        if not window:
            raise InvalidCheckpoint(f"{where}: GGUF metadata key '{arch}.attention.sliding_window' is missing: "
                                    f"gpt-oss's even layers slide over it")
        kw.update(sliding_window=int(window), sliding_layers=sliding)
    elif window:
        if family not in ("phi3", "llama", "mixtral"):
            raise _refuse(where, f"{arch}.attention.sliding_window", window)
        kw["sliding_window"] = int(window)
    read = HARMLESS_GGUF_KEYS | {"attention.sliding_window_pattern", "rope.freq_base_swa"} | (
        GRANITE_GGUF_KEYS if family == "granitemoe" else frozenset()) | (
        YARN_GGUF_KEYS if meta.get(f"{arch}.rope.scaling.type") == "yarn" else frozenset()) | (
        {"expert_shared_feed_forward_length"} if family in ("qwen2moe", "granitemoe") else frozenset())
    unknown = sorted(k[len(arch) + 1:] for k in meta.keys() if k.startswith(f"{arch}.")
                     and k[len(arch) + 1:] not in read)
    if unknown:
        raise UnsupportedArchitecture(f"{where}: GGUF key(s) {', '.join(f'{arch}.{k}' for k in unknown)} are not read "
                                      f"by ringshm and may change the math: refusing rather than ignoring them")
    return ModelConfig(**kw)


def _gguf_experts(meta: dict, tensor_names: set[str], arch: str, family: str, where: str, need) -> dict:
    """The routed-expert fields of a qwen3moe / olmoe / granitemoe / qwen2moe / gpt-oss GGUF or a llama one with
    experts (Mixtral). llama.cpp fixes the gating per arch (its ``build_moe_ffn`` calls: qwen3moe and llama
    renormalise the top-k weights, olmoe and qwen2moe do not, granitemoe renormalises, which is the softmax over the
    top-k logits of its HF original, taken that way here; gpt-oss takes the softmax of the k picked logits), so a
    file says only the counts; an ``expert_weights_norm`` /
    ``expert_gating_func`` key is refused by name, and so is a shared-expert key or tensor outside qwen2moe (whose
    shared expert, ``expert_shared_feed_forward_length`` wide, else ``feed_forward_length``, llama.cpp always gates
    by ``sigmoid(h . ffn_gate_inp_shexp)``) and granitemoe (Granite MoE Shared: ``ffn_*_shexp``, ungated)."""
    shared = family in ("qwen2moe", "granitemoe")  # granitemoe: Granite MoE Shared's files add ffn_*_shexp
    for key in ("expert_weights_norm", "expert_gating_func", "expert_weights_scale", "expert_shared_count",
                *(() if shared else ("expert_shared_feed_forward_length",))):
        if f"{arch}.{key}" in meta:
            raise _refuse(where, f"{arch}.{key}", meta[f"{arch}.{key}"], f"llama.cpp's {arch} does not read it")
    odd = min((n for n in tensor_names if ".exp_probs_b." in n
               or not shared and (".ffn_gate_shexp." in n or ".ffn_up_shexp." in n)), default=None)
    if odd is not None:
        raise _refuse(where, f"tensor {odd!r} (a shared expert or an expert bias)", "present",
                      f"a {arch} file has none")
    if need("expert_used_count") > need("expert_count"):
        raise InvalidCheckpoint(f"{where}: GGUF metadata {arch}.expert_used_count = {need('expert_used_count')} is "
                                f"more than {arch}.expert_count = {need('expert_count')}")
    out = dict(n_experts=int(need("expert_count")), n_experts_used=int(need("expert_used_count")),
               expert_intermediate=int(meta.get(f"{arch}.expert_feed_forward_length")
                                       or need("feed_forward_length")),
               expert_gating={"qwen3moe": "softmax_norm", "olmoe": "softmax", "granitemoe": "topk_softmax",
                              "mixtral": "softmax_norm", "qwen2moe": "softmax", "gptoss": "topk_softmax"}[family])
    if family == "qwen2moe":
        out.update(shared_expert_gate=True, shared_expert_intermediate=int(
            meta.get(f"{arch}.expert_shared_feed_forward_length") or need("feed_forward_length")))
    elif family == "granitemoe" and (any(".ffn_gate_shexp." in n for n in tensor_names)
                                     or f"{arch}.expert_shared_feed_forward_length" in meta):
        # llama.cpp: n_ff_shexp > 0 makes the ffn_*_shexp tensors required (the tensor check names a missing one)
        out.update(shared_expert_intermediate=int(need("expert_shared_feed_forward_length")))
    if family == "olmoe":
        out["qk_norm_full"] = True
    return out
