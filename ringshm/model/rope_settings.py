"""What a checkpoint says about RoPE, read into ``RopeScaling`` (``ringshm.model_config``): transformers' RoPE dicts
(``rope_scaling`` / ``rope_parameters``, per layer type for Gemma 3) and a GGUF's ``<arch>.rope.*`` keys and
``rope_freqs.weight``. ``ringshm.model.rope`` turns the result into inverse frequencies; ``families`` calls these
while it reads the rest of a config. A scaling ringshm does not compute is refused by name, never ignored.
"""

from __future__ import annotations

import math

from ringshm.errors import UnsupportedArchitecture
from ringshm.model_config import ROPE_SCALINGS, RopeScaling

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
    """YaRN's attention factor for a context ``factor`` (>= 1, ``RopeScaling`` checks) times longer, ``0.1 mscale
    ln(factor) + 1``: the paper's Eq. 21 as transformers' ``yarn_get_mscale`` and llama.cpp's ``rope_yarn`` take it
    (transformers returns 1 below factor 1, llama.cpp does not: a factor under 1 is refused)."""
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
    original = int(params.get("original_max_position_embeddings") or max_positions)
    if not original:  # transformers would take its config class's default max_position_embeddings
        raise _refuse(where, f"{field}.original_max_position_embeddings", None,
                      "YaRN needs the original context: set it, or max_position_embeddings")
    factor = float(params["factor"])  # the metadata rules require it
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


def _kind(params) -> str:
    return (params.get("rope_type", params.get("type")) if isinstance(params, dict) else None) or "default"


def hf_rope(c: dict, family: str, used: set, where: str) -> dict:
    """The ``ModelConfig`` RoPE fields of an HF ``config.json`` (``c``): base, scaling, and Gemma 3's local base.
    transformers 5's ``rope_parameters`` (per layer type for Gemma 3) or 4's ``rope_scaling``; a top-level
    ``original_max_position_embeddings`` wins over the dict's for llama3 and yarn (``standardize_rope_params``).

    Raises:
        UnsupportedArchitecture: a scaling not computed, YaRN on Gemma 3 (transformers reads its ``truncate`` from
            the wrong dict there), ``rope_parameters`` and ``rope_scaling`` of different kinds, or YaRN with a base
            <= 1 or no original context (each named).
    """
    used.update(("rope_theta", "rope_scaling", "rope_parameters", "rope_local_base_freq",
                 "original_max_position_embeddings"))
    params = c.get("rope_parameters")
    if family == "gemma3":
        per_type = params if isinstance(params, dict) and "full_attention" in params else {}
        full = per_type.get("full_attention") or c.get("rope_scaling") or {}
        local = per_type.get("sliding_attention") or {}
        theta = float(full.get("rope_theta", c.get("rope_theta", 1_000_000.0)))
        local_theta = float(local.get("rope_theta", c.get("rope_local_base_freq", 10_000.0)))
        for name, d in (("full_attention", full), ("sliding_attention", local)):
            if _kind(d) == "yarn":
                raise _refuse(where, f"rope_parameters.{name}.rope_type", "yarn", "YaRN on Gemma 3 is not computed")
        if rope_scaling(local, where, "rope_parameters.sliding_attention") is not None:
            raise _refuse(where, "rope_parameters.sliding_attention.rope_type", local.get("rope_type"))
        return dict(rope_theta=theta, rope_local_theta=local_theta,
                    rope_scaling=rope_scaling(full, where, "rope_parameters.full_attention"))
    legacy = c.get("rope_scaling")
    if isinstance(params, dict) and isinstance(legacy, dict) and _kind(params) != _kind(legacy):
        raise _refuse(where, "rope_scaling", legacy, f"rope_parameters says {_kind(params)!r}: one RoPE scaling")
    params = dict(params if isinstance(params, dict) else (legacy or {}))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10_000.0)))
    field = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    top = c.get("original_max_position_embeddings")
    if top and _kind(params) in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = top
    scaling = rope_scaling(params, where, field, int(c.get("max_position_embeddings") or 0))
    if scaling is not None and scaling.kind == "yarn" and not theta > 1:
        raise _refuse(where, f"{field}.rope_theta", theta, "YaRN needs a RoPE base above 1")
    return dict(rope_theta=theta, rope_scaling=scaling)


# ------------------------------------------------------------------------------------------ GGUF metadata
def gguf_rope(meta: dict, arch: str, where: str, need, rope_freqs) -> dict:
    """The ``ModelConfig`` RoPE fields of a GGUF: Llama 3's ``rope_freqs.weight`` values (``rope_freqs``, or None),
    else ``<arch>.rope.scaling.type`` none, linear (``rope.scaling.factor``) or yarn (``_gguf_yarn``); ``need(key)``
    returns ``<arch>.<key>`` or raises naming it.

    Raises:
        UnsupportedArchitecture: another scaling type, or a YaRN key ringshm does not compute (named).
    """
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if rope_freqs is not None and scaling not in (None, "none", "linear"):  # llama.cpp would apply both
        raise _refuse(where, f"{arch}.rope.scaling.type", scaling, "beside rope_freqs.weight")
    if rope_freqs is not None:
        return dict(rope_freq_factors=tuple(float(x) for x in rope_freqs))
    if scaling == "yarn":
        if not float(meta.get(f"{arch}.rope.freq_base", 10000.0)) > 1:
            raise _refuse(where, f"{arch}.rope.freq_base", meta.get(f"{arch}.rope.freq_base"),
                          "YaRN needs a RoPE base above 1")
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
