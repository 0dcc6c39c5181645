"""RoPE's inverse frequencies for one layer of a model, as ``ModelConfig`` describes them (base, scaling, GGUF
frequency factors, Gemma 3's local base on sliding layers).

Computed in fp32 with the same torch operations as transformers (``modeling_rope_utils``), so the angle tables
of an HF checkpoint match the oracle's bits: the default ``1 / theta ** (arange(0, D, 2) / D)``, then

- "linear": every inverse frequency divided by the factor (equivalent to dividing positions);
- "llama3": wavelengths ``2 pi / f`` longer than ``original_max_position / low_freq_factor`` divided by the
  factor, shorter than ``original_max_position / high_freq_factor`` kept, and those between blended with the
  smoothing weight ``(original_max_position / wavelength - low) / (high - low)`` (Llama 3.1's recipe);
- "yarn": inverse frequencies ``f / factor`` (interpolated) and ``f`` (extrapolated) mixed by a linear ramp over
  the dimension index between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original
  context (YaRN's "NTK-by-parts"), and cos / sin scaled by the attention factor (``rope_scale``);
- GGUF ``rope_freqs.weight`` (what llama.cpp's converter writes for Llama 3): the default divided by those
  per-frequency factors, as llama.cpp applies them.
"""

from __future__ import annotations

import math

import torch

from ringshm.model_config import ModelConfig


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``1 / theta ** (2i / D)`` for ``i < D / 2``: fp32 ``[D/2]`` (RoFormer, Su et al. 2021)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_inv_freq(config: ModelConfig, layer: int) -> torch.Tensor:
    """The inverse frequencies model layer ``layer`` rotates with: fp32 ``[head_dim / 2]``.

    Raises:
        ValueError: from ``RopeScaling`` (an unsupported kind is refused when the config is read).
    """
    theta, scaling, factors = config.rope_of(layer)
    inv_freq = default_inv_freq(config.head_dim, theta)
    if factors:
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inv_freq(config.head_dim, theta, scaling)
    # llama3
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_scale(config: ModelConfig, layer: int) -> float:
    """The factor on layer ``layer``'s cos / sin tables: YaRN's attention factor, else 1."""
    _, scaling, factors = config.rope_of(layer)
    return scaling.attention_factor if scaling is not None and scaling.kind == "yarn" and not factors else 1.0


def _yarn_inv_freq(dim: int, theta: float, s) -> torch.Tensor:
    """YaRN's inverse frequencies, fp32 ``[dim / 2]``, by transformers' ``_compute_yarn_parameters`` operations."""
    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the dimension, 0: interpolate it
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
