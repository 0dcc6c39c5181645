"""RoPE's inverse frequencies for one layer of a model, as ``ModelConfig`` describes them (base, scaling, GGUF
frequency factors, Gemma 3's local base on sliding layers).

Computed in fp32 with the same torch operations as transformers (``modeling_rope_utils``), so the angle tables
of an HF checkpoint match the oracle's bits: the default ``1 / theta ** (arange(0, D, 2) / D)``, then

- "linear": every inverse frequency divided by the factor (equivalent to dividing positions);
- "llama3": wavelengths ``2 pi / f`` longer than ``original_max_position / low_freq_factor`` divided by the
  factor, shorter than ``original_max_position / high_freq_factor`` kept, and those between blended with the
  smoothing weight ``(original_max_position / wavelength - low) / (high - low)`` (Llama 3.1's recipe);
- GGUF ``rope_freqs.weight`` (what llama.cpp's converter writes for Llama 3): the default divided by those
  per-frequency factors, as llama.cpp applies them.
"""

from __future__ import annotations

import math

import torch

from ringshm.config import ModelConfig


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
