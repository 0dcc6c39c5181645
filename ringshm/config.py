"""Typed, frozen configuration: what a model is (``ModelConfig``). No environment knobs.

The shape of a checkpoint comes from its own metadata (GGUF key/values or an HF ``config.json``), read by
``ringshm.loader.read_config``; nothing here reads files or the environment. An engine configuration (how to
run: stages, rows, chunk sizes) belongs in this module too, next to ``ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2): pre-norm RMSNorm, RoPE, GQA, SwiGLU MLP.

    Field names follow the field: ``n_*`` are counts, ``hidden`` is the residual width. ``head_dim`` is
    per head (``n_heads * head_dim`` need not equal ``hidden``). ``max_seq_len`` is the context length the
    checkpoint was trained for (GGUF ``<arch>.context_length``, HF ``max_position_embeddings``).

    Raises:
        ValueError: a field out of range, or ``n_heads`` not a multiple of ``n_kv_heads`` (GQA needs it).
    """

    arch: str  # "llama", "mistral" or "qwen2"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    max_seq_len: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)

    def __post_init__(self) -> None:
        for name in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads}) for GQA")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if not (self.rope_theta > 0 and self.rms_eps > 0):
            raise ValueError(f"ModelConfig.rope_theta and rms_eps must be > 0, got "
                             f"{self.rope_theta!r}, {self.rms_eps!r}")

    @property
    def q_dim(self) -> int:
        """Width of the query projection output, ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projection outputs, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim
