"""Typed, frozen configuration: what a model is (``ModelConfig``) and how an engine runs it (``EngineConfig``:
stages, rows, chunk sizes). No environment knobs.

The shape of a checkpoint comes from its own metadata (GGUF key/values or an HF ``config.json``), read by
``ringshm.model.loader.read_config``; nothing here reads files or the environment. What one request asks for
(``GenerationParams``) and its limits live in ``ringshm.generation_params``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringshm.generation_params import MAX_SPEC_K, KeywordsNamed

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


DTYPES = ("float32", "bfloat16")
MATMUL_ACTIVATIONS = ("float32", "int8")  # EngineConfig.matmul_activations
DEFAULT_BLOCK_SIZE = 32  # KV positions per block (see EngineConfig.block_size)
KV_CACHE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # EngineConfig.kv_cache_dtype: bytes per element
MAX_ROWS = 4096  # a step op holds at most one segment per row: csrc/kernels.h's RINGSHM_ATTN_MAX_SEGMENTS


@dataclass(frozen=True)
class EngineConfig(KeywordsNamed):
    """How to run a model: stage processes, rows and KV blocks, prefill chunking. No environment knobs.

    Args:
        model: a ``.gguf`` file or an HF directory; None = the default model (``ringshm.model.packaged``).
        stages: stage processes, each owning a contiguous layer range.
        layer_split: layers per stage (e.g. ``(10, 10, 10)``), summing to the model's layer count; None =
            as even as possible, earlier stages taking the remainder.
        device: "cpu", or "cuda" (stage i on GPU ``i % torch.cuda.device_count()``).
        prefill_chunk: most prompt tokens per prefill segment (chunked prefill).
        prefill_depth: step ops carrying prefill chunks in flight at once (1 = serial; more pipelines the
            stages).
        depth: step ops carrying decode / verify segments in flight at once: the pipeline's micro-batches
            (``ringshm.engine.scheduler``). None = ``ringshm.runtime.launcher.default_depth``: one per stage;
            where the stages share cores (fewer than 2 a stage, on CPU) 2 (1 for one stage), and one more per 8
            decoding streams up to one per stage. A number: exactly that many, whatever the streams.
        max_step_tokens: token budget of one step op for prefill chunks (decode and verify segments always
            go in). None = ``prefill_chunk``.
        prefill_stall_ratio: served requests (``AsyncEngine``, the server) only: while any of them decodes, a
            long prompt (more than ``prefill_chunk`` tokens to compute) rides with the decodes, the tokens of its
            chunks in flight steered so that a decode's round trip stays about this many times its round trip
            without long prompts (``ringshm.engine.prefill_budget``, measured as it runs), instead of waiting
            behind its whole prefill. None: long prompts prefill at full speed. Measured (README, "Serving under
            load"; 16 clients, 3 stages, AMD EPYC Zen 5): a 2k-token prompt held the decoding streams for its whole
            2.0 s prefill with None; with 1.5 their ITL p99 over its prefill was 2.1-2.8 x their ITL p50 and its
            TTFT 5.8-6.5 s (2.0: 3.5 x, 5.3 s). Must be > 1.
        max_seq_len: the most positions one stream may reach (prompt + generated); the engine caps it at the
            model's context length and at what the KV pool holds. It reserves nothing: KV lives in blocks sized by
            ``kv_cache_memory``.
        max_rows: streams that can be live at once (at most ``MAX_ROWS``); it reserves nothing either.
        block_size: KV positions per block (32, 64 or 128; a multiple of the attention's 32-key tile, so the
            bits do not depend on it): the granule of the KV pool and of the
            prefix cache (a hit is a whole number of blocks).
        kv_cache_memory: GiB of KV blocks over every stage together (each stage holds its layers' share of
            every block); None = enough for ``max_rows`` streams of ``max_seq_len`` positions.
        prefix_cache: reuse the KV of full blocks of earlier prompts (bit-exact: a hit changes no byte); False
            computes every prompt.
        kv_cache_dtype: what the KV blocks store, "float32", "float16" or "bfloat16" (``KV_CACHE_DTYPES``): a
            16-bit type is rounded once, on append, and read back exactly, attention accumulating in fp32, so
            every byte-identity still holds; it halves the bytes per token (twice the tokens per GiB). fp16 is
            the default by measurement (README, "KV cache in blocks"): SmolLM2 greedy stays equal to the fp32
            oracle up to float ties on every golden prompt, and decode at 1.5k positions runs 1.3 x faster;
            bf16's 8-bit mantissa moves one greedy token where the oracle's margin is 0.017.
        dtype: weights and activations, "float32" or "bfloat16".
        matmul_activations: what the CPU matmuls of quantized weights multiply, "float32" (the default: greedy equals
            the fp32 oracle on the dequantized weights) or "int8" (opt-in, ``MATMUL_ACTIVATIONS``): each
            row of a matmul's input quantized on its own per block of 32 and multiplied in exact integers
            (csrc/matmul.h's 8-bit contract, as llama.cpp's CPU matmuls do), so its outputs move ~5e-3 (relative)
            from fp32's and greedy may leave the oracle's tokens where its margin is small; every byte-identity
            (batch-mates, depth, chunking, stages, cache hits) still holds. Faster where the multiply-adds hold a
            matmul: prefill, batched decode, verify and MoE experts (README, "8-bit activations"); one stream's
            decode reads the same bytes and gains nothing. Float weights (F32 / F16 / BF16, a GGUF's MoE router) stay
            fp32. Refused with device "cuda" or dtype "bfloat16" (the torch path has no 8-bit matmul).
        op_timeout_s: the longest the coordinator waits for one reply before raising ``RingTimeout``.
        startup_timeout_s: the longest startup (every stage loaded and answering) may take.
        link_latency_ms: simulated latency of every hop (0: none), standing in for the slow links the seed
            project ran over; each receiver holds a record until its send time plus this.
        nnodes: hosts the stages run on (``ringshm.transport.cluster``): the coordinator's host is node 0, the
            others run ``ringshm worker``; between hosts the ring crosses over torch.distributed
            (``ringshm.transport.bridge``).
        node_stages: stages per node, in node order (e.g. ``(1, 3)``), summing to ``stages``; None = as even as
            possible, earlier nodes taking the remainder.
        edge_timeout_s: an edge between hosts that carries nothing for this long (no record, no heartbeat: a
            heartbeat goes every third of it) is dead; so is any error on it.
        edge_latency_ms: emulated latency on the edges between hosts only (0: none): the receiving bridge holds
            each record this long after it arrived (benchmarks of slow links).

    Raises:
        ValueError: a field out of range, with what to change.
    """

    model: str | None = None
    stages: int = 3
    layer_split: tuple[int, ...] | None = None
    device: str = "cpu"
    prefill_chunk: int = 256
    prefill_depth: int = 8
    depth: int | None = None
    max_step_tokens: int | None = None
    prefill_stall_ratio: float | None = 1.5
    max_seq_len: int = 2048
    max_rows: int = 8
    dtype: str = "float32"
    matmul_activations: str = "float32"
    op_timeout_s: float = 120.0
    startup_timeout_s: float = 600.0
    link_latency_ms: float = 0.0
    nnodes: int = 1
    node_stages: tuple[int, ...] | None = None
    edge_timeout_s: float = 5.0
    edge_latency_ms: float = 0.0
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: float | None = None
    prefix_cache: bool = True
    kv_cache_dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("stages", "prefill_chunk", "prefill_depth", "max_seq_len", "max_rows", "depth",
                     "max_step_tokens", "nnodes"):
            value = getattr(self, name)
            if value is None and name in ("depth", "max_step_tokens"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        ratio = self.prefill_stall_ratio
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 1):
            raise ValueError(f"prefill_stall_ratio must be a number > 1 or None, got {self.prefill_stall_ratio!r}")
        if self.max_rows > MAX_ROWS:
            raise ValueError(f"max_rows must be at most {MAX_ROWS} (segments of one step op), got {self.max_rows}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.matmul_activations not in MATMUL_ACTIVATIONS:
            raise ValueError(f"matmul_activations must be one of {MATMUL_ACTIVATIONS}, got "
                             f"{self.matmul_activations!r}")
        if self.matmul_activations == "int8" and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"matmul_activations='int8' runs on the CPU stages' C matmuls in float32: use "
                             f"device='cpu' and dtype='float32' with it, or matmul_activations='float32' (got "
                             f"device={self.device!r}, dtype={self.dtype!r})")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.layer_split is not None:
            split = tuple(self.layer_split)
            if len(split) != self.stages or any(not isinstance(n, int) or n < 1 for n in split):
                raise ValueError(f"layer_split must give {self.stages} layer counts >= 1 (one per stage), "
                                 f"got {self.layer_split!r}")
            object.__setattr__(self, "layer_split", split)
        if not (self.op_timeout_s > 0 and self.startup_timeout_s > 0):
            raise ValueError("op_timeout_s and startup_timeout_s must be > 0")
        if not 0 <= self.link_latency_ms <= 10_000:
            raise ValueError(f"link_latency_ms must be in [0, 10000], got {self.link_latency_ms!r}")
        if not 0 <= self.edge_latency_ms <= 10_000:
            raise ValueError(f"edge_latency_ms must be in [0, 10000], got {self.edge_latency_ms!r}")
        if not 0.3 <= self.edge_timeout_s <= 3600:
            raise ValueError(f"edge_timeout_s must be in [0.3, 3600], got {self.edge_timeout_s!r}")
        bs = self.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 32 or bs > 128 or bs & (bs - 1):
            raise ValueError(f"block_size must be 32, 64 or 128, got {bs!r}")
        kvm = self.kv_cache_memory
        if kvm is not None and (isinstance(kvm, bool) or not isinstance(kvm, (int, float)) or not 0 < kvm <= 1 << 20):
            raise ValueError(f"kv_cache_memory must be a number of GiB in (0, {1 << 20}], got {kvm!r}")
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        if self.nnodes > self.stages:
            raise ValueError(f"nnodes={self.nnodes} needs at least one stage per node: use --stages >= {self.nnodes}")
        if self.node_stages is not None:
            split = tuple(self.node_stages)
            if (len(split) != self.nnodes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split)
                    or sum(split) != self.stages):
                raise ValueError(f"node_stages must give {self.nnodes} stage counts >= 1 (one per node) summing to "
                                 f"stages={self.stages}, got {self.node_stages!r}")
            object.__setattr__(self, "node_stages", split)

    def kv_blocks(self, mc: "ModelConfig", max_seq_len: int) -> int:
        """KV blocks every stage's pool holds: ``kv_cache_memory`` GiB over the bytes one block takes in every
        layer of the model (``kv_block_bytes``), or ``max_rows`` streams of ``max_seq_len`` positions when it
        is None.

        Raises:
            ValueError: a budget below one block."""
        per_block = self.kv_block_bytes(mc)
        if self.kv_cache_memory is None:
            return self.max_rows * -(-max_seq_len // self.block_size)
        n = int(self.kv_cache_memory * 2**30 // per_block)
        if n < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory:g} GiB holds no KV block: one block of "
                             f"{self.block_size} positions takes {per_block / 2**20:.2f} MiB over the model's "
                             f"{mc.n_layers} layers: give kv_cache_memory (--kv-cache-memory) of at least "
                             f"{math.ceil(per_block / 2**30 * 1e4) / 1e4:.4f} GiB, "
                             f"or far more (a request of n positions needs ceil(n / {self.block_size}) blocks)")
        return n

    def kv_block_bytes(self, mc: "ModelConfig", n_layers: int | None = None) -> int:
        """Bytes of one KV block over ``n_layers`` layers (default: all the model's): keys and values of
        ``block_size`` positions x ``kv_dim`` in ``kv_cache_dtype``."""
        layers = mc.n_layers if n_layers is None else n_layers
        return layers * 2 * mc.kv_dim * self.block_size * KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def step_tokens(self) -> int:
        """``max_step_tokens``, or ``prefill_chunk`` when unset."""
        return self.prefill_chunk if self.max_step_tokens is None else self.max_step_tokens

    @property
    def max_op_tokens(self) -> int:
        """The most tokens one step op can carry: the prefill budget plus one verify segment of the longest
        draft (``MAX_SPEC_K`` + 1 tokens) per row. The rings and the stages' checks are sized by it."""
        return self.step_tokens + self.max_rows * (MAX_SPEC_K + 1)

    def node_stage_ranges(self) -> list[range]:
        """Each node's contiguous range of stage indices, node 0 (the coordinator's host) first."""
        if self.node_stages is None:
            base, extra = divmod(self.stages, self.nnodes)
            counts = [base + (i < extra) for i in range(self.nnodes)]
        else:
            counts = list(self.node_stages)
        ranges, start = [], 0
        for n in counts:
            ranges.append(range(start, start + n))
            start += n
        return ranges

    def layer_ranges(self, n_layers: int) -> list[range]:
        """Each stage's contiguous layer range for a model of ``n_layers``.

        Raises:
            ValueError: more stages than layers, or a ``layer_split`` that does not sum to ``n_layers``.
        """
        if self.stages > n_layers:
            raise ValueError(f"{self.stages} stages for a {n_layers}-layer model: use at most {n_layers}")
        if self.layer_split is None:
            base, extra = divmod(n_layers, self.stages)
            counts = [base + (i < extra) for i in range(self.stages)]
        else:
            counts = list(self.layer_split)
            if sum(counts) != n_layers:
                raise ValueError(f"layer_split {self.layer_split} sums to {sum(counts)}, the model has "
                                 f"{n_layers} layers")
        ranges, start = [], 0
        for n in counts:
            ranges.append(range(start, start + n))
            start += n
        return ranges
