"""What a checkpoint says about RoPE, read into ``RopeScaling`` (``ringshm.config``): transformers' RoPE dicts
(``rope_scaling`` / ``rope_parameters``, per layer type for Gemma 3) and a GGUF's ``<arch>.rope.*`` keys and
``rope_freqs.weight``. ``ringshm.model.rope`` turns the result into inverse frequencies; ``families`` calls these
while it reads the rest of a config. A scaling ringshm does not compute is refused by name, never ignored.
"""

from __future__ import annotations

import math

from ringshm.config import ROPE_SCALINGS, RopeScaling
from ringshm.errors import UnsupportedArchitecture

_refuse = UnsupportedArchitecture.setting  # "<where>: <field> = <value> is not supported (<why>)"


def rope_scaling(params: dict | None, where: str, field: str, max_positions: int = 0) -> RopeScaling | None:
    """A ``RopeScaling`` from one transformers RoPE dict, None for the default; refuses the others by name.
    ``max_positions``: the config's ``max_position_embeddings``, YaRN's original context when nothing else says."""
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind not in ROPE_SCALINGS:
        raise _refuse(where, f"{field}.rope_type", kind, f"supported: default, {', '.join(ROPE_SCALINGS)}")
    if kind == "yarn":
        return _yarn(params, where, field, max_positions)
    if float(params.get("attention_factor") or 1.0) != 1.0:
        raise _refuse(where, f"{field}.attention_factor", params["attention_factor"])
    return RopeScaling(kind, float(params["factor"]), float(params.get("low_freq_factor", 1.0)),
                       float(params.get("high_freq_factor", 4.0)),
                       int(params.get("original_max_position_embeddings") or 8192))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context ``factor`` times longer, ``0.1 mscale ln(factor) + 1`` (1 for factor
    <= 1): the paper's Eq. 21 as transformers' ``yarn_get_mscale`` and llama.cpp's ``rope_yarn`` take it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


_YARN_KEYS = {"rope_type", "type", "factor", "original_max_position_embeddings", "attention_factor", "mscale",
              "mscale_all_dim", "beta_fast", "beta_slow", "truncate", "rope_theta", "partial_rotary_factor"}


def _yarn(params: dict, where: str, field: str, max_positions: int) -> RopeScaling:
    """YaRN from a transformers RoPE dict, as ``_compute_yarn_parameters`` reads it: the attention factor given,
    or ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set (DeepSeek), else
    ``mscale(factor)``; beta_fast 32 and beta_slow 1 unless set; ``truncate`` true unless set false."""
    unread = sorted(set(params) - _YARN_KEYS)
    if unread:
        raise _refuse(where, f"{field}.{unread[0]}", params[unread[0]], "not read by ringshm's YaRN")
    if float(params.get("partial_rotary_factor") or 1.0) != 1.0:
        raise _refuse(where, f"{field}.partial_rotary_factor", params["partial_rotary_factor"],
                      "RoPE on every dimension only")
    factor = params.get("factor")
    original = int(params.get("original_max_position_embeddings") or max_positions)
    if factor is None:  # transformers: the ratio of the contexts (DeepSeek V3 writes it so)
        factor = max_positions / original
    factor = float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    try:
        return RopeScaling("yarn", factor, original_max_position=original,
                           beta_fast=float(params.get("beta_fast") or 32),
                           beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)),
                           attention_factor=float(attention))
    except ValueError as e:
        raise _refuse(where, field, params, str(e)) from None


def hf_rope(c: dict, family: str, used: set, where: str) -> dict:
    used.update(("rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq"))
    params = c.get("rope_parameters")
    if family == "gemma3":
        per_type = params if isinstance(params, dict) and "full_attention" in params else {}
        full = per_type.get("full_attention") or c.get("rope_scaling") or {}
        local = per_type.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", c.get("rope_theta", 1_000_000.0)))
        local_theta = float(local.get("rope_theta", c.get("rope_local_base_freq", 10_000.0)))
        if rope_scaling(local, where, "rope_parameters.sliding_attention") is not None:
            raise _refuse(where, "rope_parameters.sliding_attention.rope_type", local.get("rope_type"))
        return dict(rope_theta=theta, rope_local_theta=local_theta,
                    rope_scaling=rope_scaling(full, where, "rope_parameters.full_attention",
                                               int(c.get("max_position_embeddings") or 2048)))
    params = dict(params if isinstance(params, dict) else (c.get("rope_scaling") or {}))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10_000.0)))
    field = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    used.add("original_max_position_embeddings")  # llama3's band edges read it when the RoPE dict does not say
    top = c.get("original_max_position_embeddings")
    if top and ("original_max_position_embeddings" not in params  # YaRN: the top-level field wins, as transformers'
                or params.get("rope_type", params.get("type")) == "yarn"):  # standardize_rope_params has it
        params["original_max_position_embeddings"] = top
    return dict(rope_theta=theta, rope_scaling=rope_scaling(params, where, field,
                                                              int(c.get("max_position_embeddings") or 2048)))


# ------------------------------------------------------------------------------------------ GGUF metadata
def gguf_rope(meta: dict, arch: str, where: str, need, rope_freqs) -> dict:
    """The ``ModelConfig`` RoPE fields of a GGUF: Llama 3's ``rope_freqs.weight`` values (``rope_freqs``, or None),
    else ``<arch>.rope.scaling.type`` none, linear (``rope.scaling.factor``) or yarn (``_gguf_yarn``); ``need(key)``
    returns ``<arch>.<key>`` or raises naming it.

    Raises:
        UnsupportedArchitecture: another scaling type, or a YaRN key ringshm does not compute (named).
    """
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        return dict(rope_freq_factors=tuple(float(x) for x in rope_freqs))
    if scaling == "yarn":
        return dict(rope_scaling=_gguf_yarn(meta, arch, where, need, int(need("context_length"))))
    if scaling in (None, "none"):
        return {}
    if scaling != "linear":
        raise _refuse(where, f"{arch}.rope.scaling.type", scaling, "supported: none, linear, yarn, and Llama 3's "
                      "rope_freqs.weight")
    return dict(rope_scaling=RopeScaling("linear", float(need("rope.scaling.factor"))))


YARN_GGUF_KEYS = frozenset({"rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                            "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_ext_factor",
                            "rope.scaling.yarn_log_multiplier"})


def _gguf_yarn(meta: dict, arch: str, where: str, need, context: int) -> RopeScaling:
    """YaRN as llama.cpp reads it from a GGUF (``llama_model::load_hparams``, ``ggml_rope_yarn_corr_dims`` and
    ``rope_yarn``): ``rope.scaling.factor``; the original context (``original_context_length``, else the file's
    ``context_length``); the ramp's rotations (``yarn_beta_fast`` 32, ``yarn_beta_slow`` 1 unless given), its ends
    floored / ceiled; cos and sin times ``0.1 ln(factor) + 1``. Refused by name: a ramp weight other than YaRN's
    (``yarn_ext_factor`` 1, or -1: "from the type"), DeepSeek's ``yarn_log_multiplier``, and a ``yarn_attn_factor``
    other than 1 (the converter writes transformers' ``attention_factor`` there, which replaces the attention
    factor in transformers and multiplies it in llama.cpp's ``rope_yarn``: the two engines disagree)."""
    def key(name: str, default: float) -> float:
        value = meta.get(f"{arch}.rope.scaling.{name}")
        return default if value is None else float(value)

    for name, allowed, why in (("yarn_ext_factor", (-1.0, 1.0), "YaRN's full ramp (1) only"),
                               ("yarn_log_multiplier", (0.0,), "DeepSeek's YaRN attention factor is not computed"),
                               ("yarn_attn_factor", (1.0,), "transformers and llama.cpp read it differently")):
        if key(name, allowed[0]) not in allowed:
            raise _refuse(where, f"{arch}.rope.scaling.{name}", key(name, allowed[0]), why)
    factor = float(need("rope.scaling.factor"))
    try:
        return RopeScaling("yarn", factor, original_max_position=int(key("original_context_length", context)),
                           beta_fast=key("yarn_beta_fast", 32.0), beta_slow=key("yarn_beta_slow", 1.0),
                           attention_factor=yarn_mscale(factor))
    except ValueError as e:
        raise _refuse(where, f"{arch}.rope.scaling", "yarn", str(e)) from None
