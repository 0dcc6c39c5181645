"""What a model is: its shape and the per-architecture description one layer loop reads (``ModelConfig``), with
its RoPE scaling (``RopeScaling``). Typed and frozen; nothing here reads files or the environment: a checkpoint's
metadata (GGUF key/values or an HF ``config.json``) is read into it by ``ringshm.model.loader.read_config``. How an
engine runs a model lives in ``ringshm.config`` (``EngineConfig``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
"""The MLP's (or each expert's) gate: SwiGLU (Llama), GeGLU with tanh-GELU (Gemma), or gpt-oss's clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)`` (``ModelConfig.swiglu_alpha`` /
``swiglu_limit``; transformers' ``GptOssExperts._apply_gate``)."""
ROPE_SCALINGS = ("linear", "llama3", "yarn")  # what RopeScaling.kind may be; others (dynamic, longrope) are refused
EXPERT_GATINGS = ("softmax", "softmax_norm", "topk_softmax")
"""How a routed MoE layer weighs its top-k experts (``ModelConfig.expert_gating``): ``softmax`` and
``softmax_norm`` take the softmax over every expert's router logit and keep the k largest probabilities (ties to
the lowest expert id); ``softmax_norm`` then divides each by their sum (Qwen3-MoE's ``norm_topk_prob``; Mixtral),
``softmax`` keeps them as they are (OLMoE); ``topk_softmax`` keeps the k largest logits and takes the softmax over
those k alone (Granite MoE)."""
MAX_EXPERTS = 1024  # routed experts per layer (csrc/layer.h's RINGSHM_MAX_EXPERTS; DeepSeek V3: 256, Qwen3.5: 512)
MAX_EXPERTS_USED = 64  # experts per token (RINGSHM_MAX_EXPERTS_USED; the released models: 2 to 10)


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, as transformers' ``rope_scaling`` / ``rope_parameters`` describes it.

    ``kind``:
    - "linear": every inverse frequency divided by ``factor`` (positions interpolated; transformers'
      ``_compute_linear_scaling_rope_parameters``);
    - "llama3": Llama 3.1's bands: wavelengths below ``original_max_position / high_freq_factor`` kept, above
      ``original_max_position / low_freq_factor`` divided by ``factor``, smoothly blended between
      (transformers' ``_compute_llama3_parameters``);
    - "yarn": YaRN (Peng et al. 2023, arXiv:2309.00071): dimensions that turn fewer than ``beta_slow`` times over
      ``original_max_position`` interpolated (divided by ``factor``), more than ``beta_fast`` times kept, a linear
      ramp between (its ends floored / ceiled when ``truncate``), and cos / sin multiplied by
      ``attention_factor`` (transformers' ``_compute_yarn_parameters``; llama.cpp's ``rope_yarn``).

    Raises:
        ValueError: an unknown kind, a factor <= 0, llama3 bands that are empty, or YaRN's rotations or
            attention factor out of range.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0  # YaRN: rotations over original_max_position above which a dimension is kept
    beta_slow: float = 1.0  # YaRN: rotations below which it is interpolated
    truncate: bool = True  # YaRN: floor / ceil the ramp's ends (gpt-oss: False)
    attention_factor: float = 1.0  # YaRN: the factor on cos and sin (attention logits scale by its square)

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor!r}")
        if self.kind == "yarn" and not (self.factor >= 1 and 0 < self.beta_slow < self.beta_fast
                                        and self.original_max_position > 0 and 0 < self.attention_factor < 1e3):
            raise ValueError(f"yarn RoPE scaling needs factor >= 1, 0 < beta_slow < beta_fast, "
                             f"original_max_position_embeddings > 0 and 0 < attention_factor < 1000, got {self}")
        if self.kind == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor
                                          and self.original_max_position > 0):
            raise ValueError(f"llama3 RoPE scaling needs 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position_embeddings > 0, got {self}")


@dataclass(frozen=True)
class ModelConfig:
    """What a decoder computes: its shape, and the per-architecture description one layer loop reads.

    Every supported family is this one pre-norm decoder with RoPE and GQA; the fields below say where they
    differ (defaults are Llama's). Per layer on the residual stream ``x [T, hidden]``:

        h = norm(x) · (norm_offset + attn_norm)                           RMSNorm; Gemma's HF weights are (1 + w)
        q, k, v = h · Wq/Wk/Wvᵀ (+ biases: attention_bias)
        q, k = rmsnorm_per_head(q, k) (qk_norm: Qwen 3, Gemma 3), or over the whole projection (qk_norm_full: OLMoE)
        a = attention(rope(q), rope(k), v), scale attn_scale (0: 1/sqrt(head_dim)), a sliding window of
            window(layer) keys on sliding layers (0: every earlier key); with attention_sinks (gpt-oss) each
            head's softmax has one more logit, its learned sink, that weighs no value
        a = a · Woᵀ (+ o_bias);   post_norms: a = norm(a) · post_attn_norm (Gemma 2/3 "sandwich" norms)
        x = x + a
        h = norm(x) · ffn_norm;  g, u = h · Wgate/Wupᵀ (+ mlp_bias)
        m = (act(g) * u) · Wdownᵀ (+ mlp_bias);  act: silu (SwiGLU), gelu_tanh (GeGLU) or swiglu_oai (gpt-oss)
        or, with n_experts > 0 (a routed mixture of experts on every layer; no dense FFN):
            p = softmax(h · Wrouterᵀ) over the n_experts (fp32);  E = the n_experts_used largest p (ties: lowest id)
            w_e = p_e, or p_e / Σ_{E} p (expert_gating "softmax_norm"); "topk_softmax" (Granite): E = the k largest
                logits, w = softmax over those k logits alone
            m = Σ_{e in E, ascending id} w_e · ((act(h · Wgate_eᵀ) * (h · Wup_eᵀ)) · Wdown_eᵀ)   widths
                expert_intermediate; each term one rounded product, added in that order from 0; with moe_bias
                (gpt-oss) the router and each expert's gate, up and down matmuls add their biases
            with a shared expert (shared_expert_intermediate > 0; Qwen2-MoE, Granite MoE Shared): then m = m + g · s,
                s the dense FFN of width shared_expert_intermediate on h, g = sigmoid(h · w_gate_inp)
                (shared_expert_gate: Qwen2-MoE) or 1
        post_norms: m = norm(m) · post_ffn_norm
        x = x + m
    (with ``residual_scale`` != 1, Granite: x = x + a * residual_scale and x = x + m * residual_scale)

    The first stage embeds ids and multiplies by ``embed_scale`` (Gemma: sqrt(hidden); Granite: its
    embedding_multiplier); the last applies the final norm, the LM head, ``logits / logit_scale`` when that is not 1
    (Granite) and, when ``logit_softcap`` > 0, ``cap * tanh(logits / cap)``.

    RoPE: layer i rotates with ``rope_theta`` and ``rope_scaling`` (or GGUF's per-frequency ``rope_freq_factors``),
    except sliding layers of a model with ``rope_local_theta`` > 0 (Gemma 3), which use that base and no scaling.

    Field names follow the field: ``n_*`` are counts, ``hidden`` is the residual width; ``head_dim`` is per head
    (``n_heads * head_dim`` need not equal ``hidden``); ``max_seq_len`` is the context length the checkpoint was
    trained for (GGUF ``<arch>.context_length``, HF ``max_position_embeddings``).

    Raises:
        ValueError: a field out of range, ``n_heads`` not a multiple of ``n_kv_heads`` (GQA needs it), an unknown
            activation, a ``sliding_layers`` of the wrong length, or sliding layers without a window.
    """

    arch: str  # ringshm.model.families.FAMILIES: "llama", "mistral", ..., "qwen2moe", "gptoss"
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
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries a bias (Llama's attention_bias)
    mlp_bias: bool = False  # gate, up and down carry biases (Llama's mlp_bias)
    qk_norm: bool = False
    post_norms: bool = False
    norm_offset: float = 0.0  # added to every RMSNorm weight at load (Gemma's HF weights are stored as w - 1)
    activation: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0: 1 / sqrt(head_dim)
    logit_softcap: float = 0.0  # 0: none
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included (0: no sliding layer)
    sliding_layers: tuple[bool, ...] = ()  # per layer; () with a window: every layer slides (Mistral)
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] = ()  # GGUF rope_freqs.weight: inv_freq[i] / factors[i] (Llama 3)
    rope_local_theta: float = 0.0  # sliding layers' RoPE base (Gemma 3); 0: rope_theta
    qk_norm_full: bool = False  # the q / k norms cover the whole projection ([q_dim], [kv_dim]: OLMoE), not a head
    n_experts: int = 0  # routed experts per layer (0: a dense FFN)
    n_experts_used: int = 0  # top-k experts per token
    expert_intermediate: int = 0  # one expert's FFN width (HF moe_intermediate_size)
    expert_gating: str = "softmax_norm"  # EXPERT_GATINGS
    residual_scale: float = 1.0  # each branch's output times this before its residual add (Granite's muP)
    shared_expert_intermediate: int = 0  # a shared expert beside the routed ones, this wide (0: none)
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(h · w) (Qwen2-MoE's gate)
    logit_scale: float = 1.0  # the LM head's logits divided by this (Granite's logits_scaling)
    attention_sinks: bool = False  # a learned sink logit per query head in every softmax (gpt-oss)
    moe_bias: bool = False  # the router and every expert's gate, up and down carry biases (gpt-oss)
    swiglu_alpha: float = 1.702  # activation "swiglu_oai": sigmoid(alpha * g) (gpt-oss's swiglu_alpha)
    swiglu_limit: float = 7.0  # activation "swiglu_oai": the clamp on gate and up (gpt-oss's swiglu_limit)

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
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig.activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.sliding_window < 0 or (self.sliding_layers and len(self.sliding_layers) != self.n_layers):
            raise ValueError(f"ModelConfig.sliding_window must be >= 0 and sliding_layers one flag per layer "
                             f"({self.n_layers}), got {self.sliding_window}, {len(self.sliding_layers)} flags")
        if any(self.sliding_layers) and not self.sliding_window:
            raise ValueError("ModelConfig.sliding_layers are set but sliding_window is 0")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"ModelConfig.rope_freq_factors needs head_dim / 2 = {self.head_dim // 2} values, got "
                             f"{len(self.rope_freq_factors)}")
        if self.embed_scale <= 0 or self.attn_scale < 0 or self.logit_softcap < 0 or not (
                self.residual_scale > 0 and self.logit_scale > 0):
            raise ValueError("ModelConfig.embed_scale, residual_scale and logit_scale must be > 0, attn_scale and "
                             "logit_softcap >= 0")
        if self.n_experts and not (0 < self.n_experts <= MAX_EXPERTS
                                   and 0 < self.n_experts_used <= min(self.n_experts, MAX_EXPERTS_USED)
                                   and self.expert_intermediate > 0 and self.expert_gating in EXPERT_GATINGS):
            raise ValueError(f"ModelConfig: a routed MoE needs 0 < n_experts <= {MAX_EXPERTS}, 0 < n_experts_used <= "
                             f"min(n_experts, {MAX_EXPERTS_USED}), expert_intermediate > 0 and expert_gating in "
                             f"{EXPERT_GATINGS}; got {self.n_experts}, {self.n_experts_used}, "
                             f"{self.expert_intermediate}, {self.expert_gating!r}")
        if self.activation == "swiglu_oai" and not (0 < self.swiglu_alpha <= 1e6 and 0 < self.swiglu_limit <= 1e6):
            # (the C layer takes any finite value below 1e30f; 1e6 leaves the fp32 rounding no way past it)
            raise ValueError(f"ModelConfig: swiglu_oai needs 0 < swiglu_alpha, swiglu_limit <= 1e6, got "
                             f"{self.swiglu_alpha!r}, {self.swiglu_limit!r}")
        if self.moe_bias and not self.n_experts:
            raise ValueError("ModelConfig.moe_bias needs routed experts (n_experts > 0)")
        if self.shared_expert_intermediate < 0 or (self.shared_expert_intermediate and not self.n_experts) or (
                self.shared_expert_gate and not self.shared_expert_intermediate):
            raise ValueError(f"ModelConfig: a shared expert needs routed experts (n_experts > 0) and a width >= 0, its "
                             f"gate a shared expert; got shared_expert_intermediate {self.shared_expert_intermediate}, "
                             f"shared_expert_gate {self.shared_expert_gate}, n_experts {self.n_experts}")

    @property
    def moe(self) -> bool:
        """Whether every layer's FFN is a routed mixture of experts (``n_experts`` > 0)."""
        return self.n_experts > 0

    @property
    def q_dim(self) -> int:
        """Width of the query projection output, ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projection outputs, ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    def slides(self, layer: int) -> bool:
        """Whether model layer ``layer`` attends through the sliding window."""
        if not self.sliding_window:
            return False
        return self.sliding_layers[layer] if self.sliding_layers else True

    def window(self, layer: int) -> int:
        """Keys layer ``layer``'s query sees, itself included: ``sliding_window`` on a sliding layer, else 0 (all)."""
        return self.sliding_window if self.slides(layer) else 0

    def rope_of(self, layer: int) -> tuple:
        """The RoPE table layer ``layer`` rotates with, as a hashable key ``(theta, scaling, freq_factors)``;
        layers with equal keys share one table."""
        if self.rope_local_theta and self.slides(layer):
            return (self.rope_local_theta, None, ())
        return (self.rope_theta, self.rope_scaling, self.rope_freq_factors)

    @property
    def attention_scale(self) -> float:
        """The factor on q · k: ``attn_scale``, or 1 / sqrt(head_dim) when it is 0."""
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)
