"""What an engine needs before any process starts, checked up front: ring sizes (``ring_capacities``) against
free ``/dev/shm`` (``check_shm``), and weights + KV caches against available memory (``check_memory``). Each
refusal is a ``ResourceShortage`` with the numbers and what to change.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ringshm.config import EngineConfig
from ringshm.errors import ResourceShortage
from ringshm.generation_params import MAX_TOP_LOGPROBS
from ringshm.model_config import ModelConfig
from ringshm.transport.segment import SHM_DIR, shm_free_bytes

if TYPE_CHECKING:
    from ringshm.model.loader import Checkpoint

RECORD_OVERHEAD = 4096  # a record's header, row table, tensor descriptors and alignment, rounded up
MIN_RING_BYTES = 1 << 16


def _pow2(n: int) -> int:
    return 1 << max(MIN_RING_BYTES, n - 1).bit_length()


def ring_capacities(cfg: EngineConfig, hidden: int, vocab: int, max_seq_len: int) -> list[int]:
    """Data bytes of each ring (``stages + 1``), sized from what its records can be, as powers of two.

    A step op carries at most ``cfg.max_op_tokens`` tokens: ring 0 their ids (int64) and as many prompt
    target ids (int64, prompt logprobs), the rings between stages their hidden states (``[T, hidden]``, 4
    bytes each) and the targets; every op into a stage also carries its segment table (16 bytes per segment)
    and its KV block tables (int32, at most ``ceil(max_seq_len / block_size)`` per segment, at most
    ``max_rows`` segments: 64 streams at 8k positions in blocks of 32 add 64 KiB to an op), the last ring the replies
    (ids, plus fp32 logits ``[n, vocab]`` of the
    segments that sample, plus logprobs: 4 + ``MAX_TOP_LOGPROBS`` x 12 bytes per scored position). Up to
    ``prefill_depth + depth`` ops are in flight. The last ring must hold every reply in flight: the
    coordinator drains it only between sends, so a full one would block the stages while the coordinator
    waits to send. A plain or sampling stream has one decode op in flight, so all replies together carry at
    most ``max_rows`` logits rows and ``max_rows`` decode logprob positions, plus the prompt positions of the
    prefill ops (``prefill_depth`` x ``step_tokens``). The other rings only need room for a few records: when
    one is full its producer waits (backpressure) while the consumer keeps draining it. With the defaults and
    SmolLM2 (hidden 576, vocab 49152): 256 KiB, 4 MiB per hop between stages, 4 MiB.
    """
    tokens = cfg.max_op_tokens
    in_flight = cfg.prefill_depth + (cfg.stages if cfg.depth is None else cfg.depth) + 1
    tables = cfg.max_rows * (16 + 4 * -(-max_seq_len // cfg.block_size))
    ids = tokens * 8 + RECORD_OVERHEAD
    first = _pow2(in_flight * (ids + tokens * 8 + tables) + ids + tables)
    hidden_rec = tokens * (hidden * 4 + 8) + tables + RECORD_OVERHEAD
    middle = _pow2(3 * hidden_rec)  # one being read, one being written, one waiting
    logits = cfg.max_rows * vocab * 4
    per_position = 4 + MAX_TOP_LOGPROBS * 12  # lp_chosen fp32, top-k ids int64 + logprobs fp32
    logprobs = (cfg.prefill_depth * cfg.step_tokens + cfg.max_rows) * per_position
    largest = ids + logits + tokens * per_position + RECORD_OVERHEAD  # a wrap wastes at most one record's tail
    last = _pow2(in_flight * (ids + RECORD_OVERHEAD) + logits + logprobs + largest)
    return [first] + [middle] * (cfg.stages - 1) + [last]


def check_shm(capacities: list[int]) -> None:
    """Refuse, before anything is created, rings that ``/dev/shm`` has no room for.

    Raises:
        ResourceShortage: with the sizes and what to change (Docker's ``--shm-size``, fewer stages / rows).
    """
    from ringshm.transport.ring import HEADER_BYTES

    need = sum(c + HEADER_BYTES for c in capacities)
    free = shm_free_bytes()
    if need > free:
        mib = 2 ** 20
        raise ResourceShortage(
            f"the {len(capacities)} rings need {need / mib:.1f} MiB of shared memory ("
            f"{', '.join(f'{c / mib:g}' for c in capacities)} MiB) but {SHM_DIR} has {free / mib:.1f} MiB free: "
            f"enlarge it (Docker: --shm-size=1g; Kubernetes: an emptyDir with medium Memory on /dev/shm), "
            f"remove stale segments there, or use fewer stages, a smaller --prefill-chunk / --prefill-depth or "
            f"fewer --max-rows")


# Memory one stage process needs besides its weights and KV cache: the interpreter, torch and its thread
# pools, the tokenizer-free stage loop (measured ~350 MB RSS for a SmolLM2 stage with 3 layers on CPU).
STAGE_BASE_BYTES = 400 * 2**20


def stage_kv_bytes(cfg: EngineConfig, mc: ModelConfig, layers: range, n_blocks: int) -> int:
    """KV cache bytes of one stage: per layer, keys and values of ``n_blocks`` blocks
    (``[n_blocks, n_kv_heads, block_size, head_dim]`` of ``kv_cache_dtype`` each)."""
    return n_blocks * cfg.kv_block_bytes(mc, len(layers))


def available_memory_bytes() -> int:
    """Memory this process tree may still use: the system's available memory (psutil), capped by the cgroup
    v2 limit (``memory.max - memory.current``) when there is one (containers)."""
    import psutil

    avail = psutil.virtual_memory().available
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            avail = min(avail, int(limit) - int((cg / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return avail


def load_transient_bytes(ckpt: "Checkpoint", grown: list[str], native: bool, width: float) -> int:
    """Bytes (int) a stage holds only while it loads, beyond the count of its weights, when the ``grown`` tensors
    (names, from ``Checkpoint.stage_bytes``; at least one) are dequantized at load: a layer is packed at once (its
    expanded tensors exist twice until the layer's read copies are dropped: the largest layer's share), and
    ``gguf.quants`` holds about 3 x one tensor's fp32 output while it dequantizes it (2 x the largest more). A hostile
    review measured 4 layers of 64 Q2_K experts, counted with the largest tensor once, at 1.26 x the count's peak
    (2026-12-06); with this rule 0.96 x."""
    by_layer: dict[str, int] = {}
    largest = 0
    for name in grown:
        n = ckpt.source.held_bytes(name, False, 4.0 if native else width)[0]  # as held: fp32 on a native stage
        layer = re.match(r"(blk|model\.layers)\.\d+\.", name)
        key = layer.group(0) if layer else name
        by_layer[key] = by_layer.get(key, 0) + n
        largest = max(largest, n)
    return max(by_layer.values()) + 2 * largest


def check_memory(cfg: EngineConfig, mc: ModelConfig, layer_ranges: list[range], max_seq_len: int,
                 model_path: str | Path, available_bytes: int | None = None, local: range | None = None) -> None:
    """Refuse, before any stage starts, weights + KV caches that do not fit the available memory.

    Weights are counted per stage from the checkpoint's own tensor table (``Checkpoint.stage_bytes``): on CPU
    fp32 stages a tensor the matmul reads in its encoding counts its stored bytes, and one that is dequantized
    at load counts 4 bytes per weight, plus what exists only while it loads (``load_transient_bytes``); and each
    such stage holds the C layers' scratch for an op of ``cfg.max_op_tokens`` tokens
    (``layer_scratch_bytes``, reserved at start). With ``device="cuda"`` the KV cache and weights live on the GPU
    and only the per-process base is checked here. ``local``: the stages this host runs (a node of a multi-host
    engine); None = all.

    Raises:
        ResourceShortage: with the per-stage numbers and what to change.
    """
    import torch

    from ringshm.model.layer import layer_scratch_bytes
    from ringshm.model.loader import Checkpoint
    from ringshm.model.stage_model import runs_native

    gib = 2 ** 30
    n_blocks = cfg.kv_blocks(mc, max_seq_len)
    sized_by = (f"kv_cache_memory={cfg.kv_cache_memory:g} GiB" if cfg.kv_cache_memory is not None
                else f"max_rows={cfg.max_rows} x max_seq_len={max_seq_len}")
    native = runs_native(mc, cfg.device, getattr(torch, cfg.dtype))  # else dense weights (torch path)
    width = 2.0 if cfg.dtype == "bfloat16" else 4.0
    ckpt = Checkpoint.open(model_path)
    local = range(len(layer_ranges)) if local is None else local
    parts, expanded, scratch = [], [], 0
    for i in local:
        first, last = i == 0, i == len(layer_ranges) - 1
        held, grown = ckpt.stage_bytes(layer_ranges[i], first, last, native, width)
        if grown:
            held += load_transient_bytes(ckpt, grown, native, width)
        expanded += grown
        if native:
            scratch = layer_scratch_bytes(mc, cfg.max_op_tokens, cfg.matmul_activations)
            held += scratch
        parts.append((held, stage_kv_bytes(cfg, mc, layer_ranges[i], n_blocks)))
    weights, kv = sum(w for w, _ in parts), sum(k for _, k in parts)
    base = STAGE_BASE_BYTES * len(parts)
    need = base + (weights + kv if cfg.device == "cpu" else 0)
    avail = available_memory_bytes() if available_bytes is None else available_bytes
    if need > avail:
        per_stage = ", ".join(f"{(w + k) / gib:.2f}" for w, k in parts)
        grown = (f"; {len(expanded)} weight tensors are of types the matmul does not read and are expanded to fp32 "
                 f"at load (e.g. {expanded[0]})" if expanded and native else "")
        halve = "; --kv-cache-dtype float16 halves it" if cfg.kv_cache_dtype == "float32" else ""
        ops = "" if scratch * 4 <= need else (
            f"; each stage's layer scratch, {scratch / gib:.2f} GiB, grows with the tokens an op carries: a smaller "
            f"--prefill-chunk (now {cfg.prefill_chunk}) or --max-rows shrinks it")
        raise ResourceShortage(
            f"the engine needs ~{need / gib:.1f} GiB of memory (weights and layer scratch {weights / gib:.2f} GiB "
            f"+ KV cache "
            f"{kv / gib:.2f} GiB: {n_blocks} blocks of {cfg.block_size} positions of {cfg.kv_cache_dtype} for "
            f"{sized_by} + "
            f"{base / gib:.2f} GiB for {len(parts)} stage processes; per stage: {per_stage} GiB{grown}) but "
            f"{avail / gib:.1f} GiB is available: lower --kv-cache-memory (or --max-rows / --max-seq-len, which "
            f"size it when it is not given{halve}){ops}, or run more stages on more hosts")
