"""Typed, frozen configuration: what a model is (``ModelConfig``). No environment knobs.

The shape of a checkpoint comes from its own metadata (GGUF key/values or an HF ``config.json``), read by
``ringshm.model.loader.read_config``; nothing here reads files or the environment. An engine configuration (how to
run: stages, rows, chunk sizes) belongs in this module too, next to ``ModelConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: SwiGLU (Llama) or GeGLU with tanh-GELU (Gemma)
ROPE_SCALINGS = ("linear", "llama3")  # what RopeScaling.kind may be; others (yarn, dynamic, longrope) are refused


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling, as transformers' ``rope_scaling`` / ``rope_parameters`` describes it.

    ``kind``:
    - "linear": every inverse frequency divided by ``factor`` (positions interpolated; transformers'
      ``_compute_linear_scaling_rope_parameters``);
    - "llama3": Llama 3.1's bands: wavelengths below ``original_max_position / high_freq_factor`` kept, above
      ``original_max_position / low_freq_factor`` divided by ``factor``, smoothly blended between
      (transformers' ``_compute_llama3_parameters``).

    Raises:
        ValueError: an unknown kind, a factor <= 0, or llama3 bands that are empty.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling {self.kind!r} is not supported (supported: {', '.join(ROPE_SCALINGS)})")
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor!r}")
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
        q, k = rmsnorm_per_head(q, k) (qk_norm: Qwen 3, Gemma 3)
        a = attention(rope(q), rope(k), v), scale attn_scale (0: 1/sqrt(head_dim)), a sliding window of
            window(layer) keys on sliding layers (0: every earlier key)
        a = a · Woᵀ (+ o_bias);   post_norms: a = norm(a) · post_attn_norm (Gemma 2/3 "sandwich" norms)
        x = x + a
        h = norm(x) · ffn_norm;  g, u = h · Wgate/Wupᵀ (+ mlp_bias)
        m = (act(g) * u) · Wdownᵀ (+ mlp_bias);  act: silu (SwiGLU) or gelu_tanh (GeGLU)
        post_norms: m = norm(m) · post_ffn_norm
        x = x + m

    The first stage embeds ids and multiplies by ``embed_scale`` (Gemma: sqrt(hidden)); the last applies the
    final norm, the LM head and, when ``logit_softcap`` > 0, ``cap * tanh(logits / cap)``.

    RoPE: layer i rotates with ``rope_theta`` and ``rope_scaling`` (or GGUF's per-frequency ``rope_freq_factors``),
    except sliding layers of a model with ``rope_local_theta`` > 0 (Gemma 3), which use that base and no scaling.

    Field names follow the field: ``n_*`` are counts, ``hidden`` is the residual width; ``head_dim`` is per head
    (``n_heads * head_dim`` need not equal ``hidden``); ``max_seq_len`` is the context length the checkpoint was
    trained for (GGUF ``<arch>.context_length``, HF ``max_position_embeddings``).

    Raises:
        ValueError: a field out of range, ``n_heads`` not a multiple of ``n_kv_heads`` (GQA needs it), an unknown
            activation, a ``sliding_layers`` of the wrong length, or sliding layers without a window.
    """

    arch: str  # "llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3"
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
        if self.embed_scale <= 0 or self.attn_scale < 0 or self.logit_softcap < 0:
            raise ValueError("ModelConfig.embed_scale must be > 0, attn_scale and logit_softcap >= 0")

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
DEFAULT_BLOCK_SIZE = 32  # KV positions per block (see EngineConfig.block_size)
KV_CACHE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}  # EngineConfig.kv_cache_dtype: bytes per element
MAX_ROWS = 4096  # a step op holds at most one segment per row: csrc/kernels.h's RINGSHM_ATTN_MAX_SEGMENTS


@dataclass(frozen=True)
class EngineConfig:
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
            (``ringshm.engine.scheduler``). None = ``ringshm.runtime.launcher.default_depth``: one per stage
            where every stage computes on its own (a GPU each, or 2+ cores per stage), else 1.
        max_step_tokens: token budget of one step op for prefill chunks (decode and verify segments always
            go in). None = ``prefill_chunk``.
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
    max_seq_len: int = 2048
    max_rows: int = 8
    dtype: str = "float32"
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
        if self.max_rows > MAX_ROWS:
            raise ValueError(f"max_rows must be at most {MAX_ROWS} (segments of one step op), got {self.max_rows}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
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


SPEC_METHODS = (None, "ngram")
MAX_TOP_LOGPROBS = 20  # the most top-k entries per position: OpenAI's chat top_logprobs limit (vLLM's default cap)
MAX_SPEC_K = 16  # most draft tokens per verify segment (it bounds a step op's size, EngineConfig.max_op_tokens)

# Sampling values whose arithmetic fp32 carries out. The sampler divides fp32 logits by the temperature and by the
# repetition penalty: a divisor under fp32's range (1e-300 is 0 there) turns logits into inf / NaN. Logits of
# real models stay far below 1e4, so with these limits every processed logit stays finite.
MIN_TEMPERATURE = 1e-2  # a temperature in (0, 1e-2) samples at 1e-2 (vLLM's rule, SamplingParams' _MAX_TEMP)
MAX_TEMPERATURE = 100.0  # above it a step's distribution is uniform to fp32 precision anyway
REPETITION_PENALTY_RANGE = (1e-2, 1e2)  # HF / vLLM use 1 .. 2; 1e-2 .. 1e2 keeps logit / r and logit * r finite
MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI allows 4)
MAX_STOP_CHARS = 256  # characters per stop string
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; stream i of a batch uses seed + i


@dataclass(frozen=True)
class GenerationParams:
    """How to generate for one request (``Engine.generate`` and friends take these as keyword arguments).

    Args:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: 0 = greedy (default); > 0 samples, with ``top_k`` (0: no cut) and ``top_p`` (nucleus). At
            most ``MAX_TEMPERATURE`` (100); a value in (0, ``MIN_TEMPERATURE``) samples at 1e-2 (vLLM's rule:
            logits / temperature must stay finite in fp32).
        seed: sampling seed (same seed, same tokens), an int in [-2**63, 2**64 - 1 - batch size]; in a batch,
            stream i uses ``seed + i``.
        stop: at most ``MAX_STOP_STRINGS`` (16) strings of 1 .. ``MAX_STOP_CHARS`` (256) characters that end the
            generation (the text is cut before the first one to appear).
        chat: apply the model's chat template to a string prompt.
        prefill_depth: prefill ops in flight for this request (default: the engine's).
        spec: None, or "ngram" for lossless speculative decoding with prompt-lookup drafts (greedy only).
        spec_k: most draft tokens per verify segment (1 .. ``MAX_SPEC_K``). spec_depth: verify segments in
            flight per stream (the request's decode window is raised to it).
        spec_ngram: longest suffix n-gram the drafter matches.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit (OpenAI's rule; ids are
            checked against the vocabulary by the engine).
        presence_penalty, frequency_penalty: in [-2, 2]; ``presence * (count > 0) + frequency * count`` is
            subtracted from the logit of each token generated ``count`` times so far (OpenAI's rule).
        repetition_penalty: in [0.01, 100] (1 = off); a token seen in the prompt or the output has its logit
            divided by it when positive, multiplied when not (Keskar et al. 2019, CTRL; vLLM / HF's rule).
        min_tokens: EOS ids are masked until this many tokens are generated, and stop strings are not looked
            for in their text (vLLM's rule); at most ``max_new_tokens``.
        ignore_eos: EOS does not end the stream (it runs to ``max_new_tokens`` or a stop string).
        logprobs: None (off) or k in [0, ``MAX_TOP_LOGPROBS``]: each generated token's logprob and the k most
            likely tokens at its position (vLLM's ``SamplingParams.logprobs``). They are the raw model's
            log-softmax, before temperature, penalties and logit_bias (vLLM's default ``raw_logprobs``).
        prompt_logprobs: None (off) or k in [0, ``MAX_TOP_LOGPROBS``]: the logprob of each prompt token after
            the first given the ones before it, and the k most likely there (the first token has none).
        cache_salt: a tenant key (any string; vLLM's field): the prompt's prefix-cache chain is this key's
            alone, so another tenant cannot find out by timing which prefixes were served. None: the shared chain.
        The order the sampler applies them in: ``ringshm.engine.sampling.Sampler``. Any of logit_bias, the penalties
        or min_tokens makes even a greedy request take the last stage's logits, and rules out ``spec``.

    Raises:
        ValueError: a field out of range, saying what to change.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat: bool = False
    prefill_depth: int | None = None
    spec: str | None = None
    spec_k: int = 4
    spec_depth: int = 1
    spec_ngram: int = 3
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

    @property
    def processes_logits(self) -> bool:
        """Whether a logit control is set (logit_bias, a penalty, min_tokens): the next token is then chosen
        from processed logits, greedy or not."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 or (
            self.repetition_penalty != 1 or self.min_tokens > 0)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        object.__setattr__(self, "temperature", check_temperature(self.temperature))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(self.cache_salt).__name__}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no cut), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {shown(self.seed)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.prefill_depth is not None and (not isinstance(self.prefill_depth, int) or self.prefill_depth < 1):
            raise ValueError(f"prefill_depth must be an int >= 1, got {self.prefill_depth!r}")
        object.__setattr__(self, "stop", check_stop(self.stop))
        if self.spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {SPEC_METHODS}, got {self.spec!r}")
        if self.spec is not None and self.temperature > 0:
            raise ValueError("speculative decoding here is greedy-only (lossless): use temperature 0 "
                             "(--temperature 0) or turn speculation off (spec=None, no --spec)")
        for name in ("spec_k", "spec_depth", "spec_ngram"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.spec_k > MAX_SPEC_K:
            raise ValueError(f"spec_k must be at most {MAX_SPEC_K} (drafts per verify segment), got {self.spec_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
        check_repetition_penalty(self.repetition_penalty)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_new_tokens "
                             f"({self.max_new_tokens}): lower min_tokens or raise max_new_tokens")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_TOP_LOGPROBS}] (top-k count), got "
                                 f"{value!r}")
        if self.spec is not None and (self.logprobs is not None or self.prompt_logprobs is not None):
            raise ValueError("speculative decoding does not return logprobs: drop logprobs / prompt_logprobs or "
                             "turn speculation off (spec=None, no --spec)")
        if self.spec is not None and self.processes_logits:
            raise ValueError("speculative decoding verifies the stage's plain argmax, so it cannot apply "
                             "logit_bias, presence/frequency/repetition penalties or min_tokens: drop those or "
                             "turn speculation off (spec=None, no --spec)")


def shown(value, n_chars: int = 40) -> str:
    """``repr(value)`` cut to about ``n_chars`` characters, for error messages (an int of 5,000 digits cannot even
    be turned into a string: Python's int-to-str limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an int of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= n_chars else text[:n_chars] + "..."


def check_temperature(temperature: float) -> float:
    """The temperature a request samples at: 0 (greedy) as is, a value in (0, ``MIN_TEMPERATURE``) raised to it.

    Raises:
        ValueError: below 0 or above ``MAX_TEMPERATURE``.
    """
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature}")
    return max(float(temperature), MIN_TEMPERATURE) if temperature > 0 else 0.0


def check_repetition_penalty(r: float) -> None:
    """Raises ValueError unless ``r`` lies in ``REPETITION_PENALTY_RANGE`` (its fp32 arithmetic stays finite)."""
    lo, hi = REPETITION_PENALTY_RANGE
    if not lo <= r <= hi:
        raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off), got {r}")


def check_stop(stop) -> tuple[str, ...]:
    """``stop`` (a string, or a list / tuple of them) as a tuple of strings.

    Raises:
        ValueError: more than ``MAX_STOP_STRINGS`` strings, an empty one, one longer than ``MAX_STOP_CHARS``
            characters, or something that is not a string. The caps bound the text work a request brings to the
            dispatcher thread that serves every stream (``ringshm.engine.sampling.TextStream``).
    """
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is None:
        return ()
    if not isinstance(stop, (list, tuple)) or any(not isinstance(x, str) or not x for x in stop):
        raise ValueError(f"stop must be a non-empty string or a list of them, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    long = next((i for i, x in enumerate(stop) if len(x) > MAX_STOP_CHARS), None)
    if long is not None:
        raise ValueError(f"stop[{long}] has {len(stop[long])} characters; at most {MAX_STOP_CHARS} are allowed")
    return tuple(stop)


LOGIT_BIAS_LIMIT = 100.0  # OpenAI: logit_bias values lie in [-100, 100]


def check_logit_bias(logit_bias, vocab: int | None = None) -> dict[int, float] | None:
    """``logit_bias`` as a fresh ``{token id: bias}`` dict (None when empty).

    Raises:
        ValueError: not a dict, a key that is not an int >= 0 (or, given ``vocab``, not below it), a bias that
            is not a finite number in [-100, 100].
    """
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
    out = {}
    for token, bias in logit_bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
        if vocab is not None and token >= vocab:
            raise ValueError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab})")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
                or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        out[token] = float(bias)
    return out or None
