"""How an engine runs a model (``EngineConfig``: stages, rows and KV blocks, prefill chunking), typed and frozen.
No environment knobs.

What a model is (``ModelConfig``) lives in ``ringshm.model_config``; what one request asks for
(``GenerationParams``) and its limits in ``ringshm.generation_params``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringshm.generation_params import MAX_SPEC_K, KeywordsNamed

if TYPE_CHECKING:
    from ringshm.model_config import ModelConfig


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
            matmul: prefill, batched decode, verify and MoE experts; one stream's decode reads the same bytes and gains
            only where the fp32 decode runs out of vector ops first (AMD Zen 4: 1.13-1.14 x on the default model and
            the 1B shape; bench/HISTORY.md, Zen 4, 2026-12-06 16:27). Float weights (F32 / F16 / BF16, a GGUF's MoE
            router) stay fp32. Refused with device "cuda" or dtype "bfloat16" (the torch path has no 8-bit matmul).
        row_prefetch: whether the stages' C matmuls ask for the packed weight rows ahead (software prefetch) of the
            types read in the order they are stored, and attention for the next tile of its fp32 KV: None (the default)
            the CPU's choice per op (``ringshm.model.qmatmul.row_prefetch_for``; csrc/matmul.c has the measurements):
            every op on AMD Zen 5 and later (it streamed Q4_K 1.2 x and the 8-bit Q4_K 2.4 x as fast at one row); on
            AMD Zen 4 the fp32 ops of 4 rows or more, 6 of a float weight (0.84-0.96 x their time; one row and 8-bit
            ops ran as fast or slower with it); no op elsewhere. True or False forces it for every op, for a CPU not
            measured. Speed only: no byte of any output changes.
        huge_pages: whether the stages ask the kernel for 2 MiB pages for their packed weights (True, the default;
            ``ringshm.model.hugepages``: Linux transparent huge pages where the system allows them): on an AMD EPYC
            Zen 5 one stream decoded 0.99-1.14 x as fast, a load where memory is fragmented took ~1.5 s more per
            GB for the compaction (the 30B shape's loaded faster). False keeps 4 KiB pages. Speed only.
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
    row_prefetch: bool | None = None
    huge_pages: bool = True
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
        if self.row_prefetch is not None and not isinstance(self.row_prefetch, bool):
            raise ValueError(f"row_prefetch must be True, False or None (the CPU's choice), got {self.row_prefetch!r}")
        if not isinstance(self.huge_pages, bool):
            raise ValueError(f"huge_pages must be True or False, got {self.huge_pages!r}")
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
