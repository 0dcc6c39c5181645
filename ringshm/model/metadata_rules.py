"""What a metadata value of a checkpoint may be: the type and range of every key ringshm or its tokenizer reads
(``GGUF_RULES`` under ``<arch>.``, ``TOKENIZER_RULES`` / ``TOKENIZER_ARRAYS``, ``HF_RULES`` for ``config.json``),
and the bounds behind them. A rule is a ``Check``: ``check(label, value)`` returns, or raises an
``InvalidCheckpoint`` ``"<label> = <value>: expected <what>"`` (the value shown cut short: a hostile one may be
huge or deep). ``ringshm.model.checkpoint_check`` runs them; what the values mean is ``ringshm.model.families``'.

Integers are ints (not bools, floats, strings or lists), numbers finite (NaN and inf refused), and every count
or width lies between 1 and a bound far above any released model, so that nothing sized from a value (a loop
over layers, a RoPE table, a ring) can be made huge by a file.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable

from ringshm.errors import InvalidCheckpoint
from ringshm.model.gguf_index import MAX_ARRAY_LEN
from ringshm.model_config import MAX_EXPERTS, MAX_EXPERTS_USED, ROPE_SCALINGS

# Bounds on what a model may declare (each far above any released model; the README lists them).
MAX_CONTEXT = 1 << 24  # positions (Llama 4 Scout: 10M)
MAX_LAYERS = 1024  # (Llama 3.1 405B: 126)
MAX_HIDDEN = 1 << 16  # (405B: 16,384)
MAX_INTERMEDIATE = 1 << 20  # (405B: 53,248)
MAX_HEADS = 1024  # query or KV heads (405B: 128)
MAX_HEAD_DIM = 1024  # (Gemma 3: 256)
MAX_VOCAB = MAX_ARRAY_LEN  # 524,288 (Gemma 3: 262,144)
MAX_ROPE_BASE = 1e12  # (Llama 4: 5e5; long-context Qwen: 1e8)
MAX_FACTOR = 1e6  # RoPE scaling factors, soft-caps, attention scalars
MAX_EOS_IDS = 64
TOKEN_ID_KEY = re.compile(r"tokenizer\.ggml\.\w+_token_id")


SHOW = reprlib.Repr()  # values in messages: at most 60 characters, 6 items, 2 levels deep
SHOW.maxstring, SHOW.maxother, SHOW.maxlist, SHOW.maxdict, SHOW.maxlevel = 60, 60, 6, 6, 2

Check = Callable[[str, object], None]  # (label, value) -> None; raises InvalidCheckpoint


def bad_value(label: str, value, expected: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"{label} = {SHOW.repr(value)}: expected {expected}")


def int_in(lo: int, hi: int, null: bool = False) -> Check:
    def check(label, v):
        if v is None and null:
            return
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise bad_value(label, v, f"an integer in [{lo}, {hi}]")
    return check


def number_in(lo: float, hi: float, lo_open: bool = True, null: bool = False) -> Check:
    def check(label, v):
        if v is None and null:
            return
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v <= hi and (
            v > lo if lo_open else v >= lo)
        if not ok:
            raise bad_value(label, v, f"a finite number {'>' if lo_open else '>='} {lo:g} and <= {hi:g}")
    return check


def boolean(null: bool = False) -> Check:
    def check(label, v):
        if not (isinstance(v, bool) or (v is None and null)):
            raise bad_value(label, v, "true or false")
    return check


def string(null: bool = False) -> Check:
    def check(label, v):
        if not (isinstance(v, str) or (v is None and null)):
            raise bad_value(label, v, "a string")
    return check


def _str_list(label, v):
    if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
        raise bad_value(label, v, "a list of strings, or null")


def _int_list(label, v):
    if v is not None and (not isinstance(v, list) or len(v) > MAX_LAYERS or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_LAYERS for x in v)):
        raise bad_value(label, v, f"a list of layer indices (at most {MAX_LAYERS}), or null")


def _sub(label: str, key) -> str:
    """The label of ``key`` inside the value ``label`` names: ``x: 'rope_scaling'`` -> ``x: 'rope_scaling.factor'``."""
    part = f"[{key}]" if isinstance(key, int) else f".{key}"
    return f"{label[:-1]}{part}'" if label.endswith("'") else f"{label}{part}"


def _rope_dict(label, v):
    """A transformers RoPE dict (``rope_scaling``, ``rope_parameters`` or one of Gemma 3's per layer type)."""
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad_value(label, v, "an object of RoPE settings or null")
    if v and all(isinstance(x, dict) for x in v.values()):  # Gemma 3: one dict per layer type
        for k, sub in v.items():
            _rope_dict(_sub(label, k), sub)
        return
    for key, rule in _ROPE_RULES.items():
        if key in v:
            rule(_sub(label, key), v[key])
    kind = v.get("rope_type", v.get("type", "default"))
    if kind in ROPE_SCALINGS and "factor" not in v:
        raise InvalidCheckpoint(f"{label}: rope_type {kind!r} needs a 'factor', and there is none")


_ROPE_RULES = {
    "rope_type": string(),
    "type": string(),
    "factor": number_in(0, MAX_FACTOR),
    "low_freq_factor": number_in(0, MAX_FACTOR),
    "high_freq_factor": number_in(0, MAX_FACTOR),
    "original_max_position_embeddings": int_in(1, MAX_CONTEXT, null=True),
    "attention_factor": number_in(0, MAX_FACTOR, null=True),
    "rope_theta": number_in(0, MAX_ROPE_BASE),
    "beta_fast": number_in(0, MAX_FACTOR, null=True),  # YaRN's ramp ends, in rotations over the original context
    "beta_slow": number_in(0, MAX_FACTOR, null=True),
    "mscale": number_in(0, MAX_FACTOR, lo_open=False, null=True),
    "mscale_all_dim": number_in(0, MAX_FACTOR, lo_open=False, null=True),
    "truncate": boolean(null=True),
    "partial_rotary_factor": number_in(0, 1, null=True),
}


def _eos(label, v):
    """``eos_token_id``: one id, a list of 1 to MAX_EOS_IDS ids, or null (the vocabulary bound is checked after)."""
    one = int_in(0, MAX_VOCAB - 1)
    if v is None:
        return
    if not isinstance(v, list):
        one(label, v)
        return
    if not 1 <= len(v) <= MAX_EOS_IDS:
        raise bad_value(label, v, f"a token id, a list of 1 to {MAX_EOS_IDS} token ids, or null")
    for i, x in enumerate(v):
        one(_sub(label, i), x)


def _layer_pattern(label, v):
    """GGUF ``attention.sliding_window_pattern``: a period (every n-th layer global) or one bool per layer."""
    if isinstance(v, list):
        if not all(isinstance(x, bool) for x in v):
            raise bad_value(label, v, "a layer period, or one bool per layer")
        return
    int_in(1, MAX_LAYERS)(label, v)


# HF config.json: every field ringshm reads (families_hf.hf_config); required ones are in HF_REQUIRED.
HF_RULES: dict[str, Check] = {
    "model_type": string(),
    "num_attention_heads": int_in(1, MAX_HEADS),
    "num_key_value_heads": int_in(1, MAX_HEADS, True),
    "hidden_size": int_in(1, MAX_HIDDEN),
    "num_hidden_layers": int_in(1, MAX_LAYERS),
    "head_dim": int_in(2, MAX_HEAD_DIM, True),
    "intermediate_size": int_in(1, MAX_INTERMEDIATE),
    "vocab_size": int_in(1, MAX_VOCAB),
    "rms_norm_eps": number_in(0, 1),
    "tie_word_embeddings": boolean(),
    "max_position_embeddings": int_in(1, MAX_CONTEXT),
    "bos_token_id": int_in(0, MAX_VOCAB - 1, True),
    "eos_token_id": _eos,
    "pad_token_id": int_in(0, MAX_VOCAB - 1, True),
    "hidden_act": string(True),
    "hidden_activation": string(True),
    "rope_theta": number_in(0, MAX_ROPE_BASE),
    "rope_local_base_freq": number_in(0, MAX_ROPE_BASE),
    "rope_scaling": _rope_dict,
    "rope_parameters": _rope_dict,
    "original_max_position_embeddings": int_in(1, MAX_CONTEXT, True),
    "attention_bias": boolean(),
    "mlp_bias": boolean(),
    "sliding_window": int_in(0, MAX_CONTEXT, True),
    "layer_types": _str_list,
    "use_sliding_window": boolean(True),
    "sliding_window_pattern": int_in(1, MAX_LAYERS, True),
    "_sliding_window_pattern": int_in(1, MAX_LAYERS, True),
    "query_pre_attn_scalar": number_in(0, 1 << 20),
    "final_logit_softcapping": number_in(0, MAX_FACTOR, null=True),
    "attn_logit_softcapping": number_in(0, MAX_FACTOR, null=True),
    "use_bidirectional_attention": boolean(True),
    "partial_rotary_factor": number_in(0, 1),
    "num_experts": int_in(1, MAX_EXPERTS, True),
    "num_local_experts": int_in(1, MAX_EXPERTS, True),
    "num_experts_per_tok": int_in(1, MAX_EXPERTS_USED, True),
    "moe_intermediate_size": int_in(1, MAX_INTERMEDIATE, True),
    "shared_expert_intermediate_size": int_in(0, MAX_INTERMEDIATE, True),
    "shared_intermediate_size": int_in(0, MAX_INTERMEDIATE, True),
    "norm_topk_prob": boolean(True),
    "decoder_sparse_step": int_in(1, MAX_LAYERS, True),
    "mlp_only_layers": _int_list,
    "clip_qkv": number_in(0, MAX_FACTOR, null=True),
    "output_router_logits": boolean(True),
    "router_aux_loss_coef": number_in(0, MAX_FACTOR, lo_open=False, null=True),
    "embedding_multiplier": number_in(0, MAX_FACTOR, null=True),
    "attention_multiplier": number_in(0, MAX_FACTOR, null=True),
    "residual_multiplier": number_in(0, MAX_FACTOR, null=True),
    "logits_scaling": number_in(0, MAX_FACTOR, null=True),
    "swiglu_alpha": number_in(0, MAX_FACTOR),  # gpt-oss's clamped SwiGLU
    "swiglu_limit": number_in(0, MAX_FACTOR),
}
HF_REQUIRED = ("model_type", "num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size",
               "vocab_size")

# GGUF metadata under "<arch>.": every key families_gguf.gguf_config reads; required ones in GGUF_REQUIRED.
GGUF_RULES: dict[str, Check] = {
    "embedding_scale": number_in(0, MAX_FACTOR),
    "residual_scale": number_in(0, MAX_FACTOR),
    "attention.scale": number_in(0, MAX_FACTOR),
    "logit_scale": number_in(0, MAX_FACTOR),
    "expert_count": int_in(1, MAX_EXPERTS),
    "expert_used_count": int_in(1, MAX_EXPERTS_USED),
    "expert_feed_forward_length": int_in(1, MAX_INTERMEDIATE),
    "expert_shared_feed_forward_length": int_in(1, MAX_INTERMEDIATE),
    "context_length": int_in(1, MAX_CONTEXT),
    "embedding_length": int_in(1, MAX_HIDDEN),
    "block_count": int_in(1, MAX_LAYERS),
    "feed_forward_length": int_in(1, MAX_INTERMEDIATE),
    "attention.head_count": int_in(1, MAX_HEADS),
    "attention.head_count_kv": int_in(1, MAX_HEADS),
    "attention.key_length": int_in(2, MAX_HEAD_DIM),
    "attention.value_length": int_in(2, MAX_HEAD_DIM),
    "attention.layer_norm_rms_epsilon": number_in(0, 1),
    "rope.freq_base": number_in(0, MAX_ROPE_BASE),
    "rope.freq_base_swa": number_in(0, MAX_ROPE_BASE),
    "rope.dimension_count": int_in(1, MAX_HEAD_DIM),
    "vocab_size": int_in(1, MAX_VOCAB),
    "rope.scaling.type": string(),
    "rope.scaling.factor": number_in(0, MAX_FACTOR),
    "rope.scaling.original_context_length": int_in(1, MAX_CONTEXT),
    "rope.scaling.yarn_beta_fast": number_in(0, MAX_FACTOR),
    "rope.scaling.yarn_beta_slow": number_in(0, MAX_FACTOR),
    "rope.scaling.yarn_attn_factor": number_in(0, MAX_FACTOR),
    "rope.scaling.yarn_ext_factor": number_in(-1, MAX_FACTOR, lo_open=False),
    "rope.scaling.yarn_log_multiplier": number_in(0, MAX_FACTOR, lo_open=False),
    "rope.scaling.finetuned": boolean(),
    "attention.sliding_window": int_in(0, MAX_CONTEXT),
    "attention.sliding_window_pattern": _layer_pattern,
    "final_logit_softcapping": number_in(0, MAX_FACTOR, lo_open=False),
}
GGUF_REQUIRED = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
                 "attention.layer_norm_rms_epsilon")
# The tokenizer's keys (transformers converts them); arrays by element type.
TOKENIZER_RULES: dict[str, Check] = {
    "tokenizer.ggml.model": string(),
    "tokenizer.ggml.pre": string(),
    "tokenizer.chat_template": string(),
    "tokenizer.ggml.add_bos_token": boolean(),
    "tokenizer.ggml.add_eos_token": boolean(),
    "tokenizer.ggml.add_space_prefix": boolean(),
}
TOKENIZER_ARRAYS = {"tokenizer.ggml.tokens": "STRING", "tokenizer.ggml.merges": "STRING",
                    "tokenizer.ggml.scores": "FLOAT32", "tokenizer.ggml.token_type": "INT32"}
