"""The stage process: one single-threaded loop that takes the next op from its input ring, applies it to its
``StageModel`` and puts the result on its output ring, strictly in arrival order.

Arrival order is the invariant the coordinator relies on: because every stage applies ops in the order it
received them, keeping many step ops in flight (pipelined prefill, decode micro-batches, speculative verify
chains) gives exactly the serial result.

A failed op (bad row, KV overflow) becomes an ERROR reply that every later stage forwards untouched; the
stage keeps serving. A stage whose upstream peer dies or closes its ring exits (``PeerDied``), so a killed
coordinator never leaves stages behind.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

from ringshm.runtime.stage_status import (  # noqa: F401 - the status layout, read by the launcher and tests here
    EXITED,
    FAILED,
    LOADED,
    N_SLOTS,
    SLOT_ACTIVE,
    SLOT_BUSY_S,
    SLOT_OPS,
    SLOT_STATE,
    STARTING,
)
from ringshm.runtime.stage_threads import ThreadPicker


@dataclass(frozen=True)
class StageSpec:
    """Everything a stage process needs, as plain values (pickled once at process start; the
    rings themselves carry no pickle)."""

    index: int
    n_stages: int
    model_path: str
    layer_start: int
    layer_stop: int
    max_rows: int
    max_seq_len: int
    dtype: str
    device: str
    in_ring: str
    out_ring: str
    cores: int  # CPU cores the stages share; intra-op threads are picked per op from them (ThreadPicker)
    ring_timeout_s: float
    max_op_tokens: int  # the op budget (EngineConfig.max_op_tokens): larger step ops are refused; sizes the scratch
    link_latency_ms: float = 0.0
    block_size: int = 32  # KV positions per block (EngineConfig.block_size)
    n_blocks: int | None = None  # KV blocks in each layer's pool (the engine's KV budget); None: max_rows full rows
    kv_dtype: str = "float32"  # what the KV blocks store (EngineConfig.kv_cache_dtype)
    matmul_activations: str = "float32"  # what the C matmuls multiply (EngineConfig.matmul_activations)
    row_prefetch: bool | None = None  # the C matmuls' row prefetch (EngineConfig.row_prefetch): None the CPU's choice
    huge_pages: bool = True  # packed weights in 2 MiB pages (EngineConfig.huge_pages)
    node: int = 0  # the host it runs on (ringshm.transport.cluster): set explicitly, never inferred from shared memory
    gpu: int | None = None  # device="cuda": the GPU this stage binds (CUDA_VISIBLE_DEVICES, set before CUDA starts)


def process_title(spec: StageSpec) -> str:
    """What ``ps`` shows for a stage: ``ringshm stage 1/3 layers 10-19`` (``... node 1`` on node 1 and up)."""
    return (f"ringshm stage {spec.index}/{spec.n_stages} layers {spec.layer_start}-{spec.layer_stop - 1}"
            + (f" node {spec.node}" if spec.node else ""))


def stage_main(spec: StageSpec, status, errors=None, ended=None) -> None:
    """Process entry point: attach the rings, load the layers, serve ops until SHUTDOWN or a dead peer.

    ``status``: the shared counters (``N_SLOTS`` doubles per stage). ``errors``: the shared error buffer
    (``ringshm.transport.error_buffer``, a slot per stage): a load error is written there, then the state
    becomes FAILED, before the process exits, so the coordinator always reads the stage's own error,
    whichever it sees first. Any other exception that ends the loop (outside an op: an op's own error is an
    ERROR reply and the loop goes on) is written there too, and the process exits 1: a stage exits 0 only
    after SHUTDOWN or when a peer is gone. ``ended``: the coordinator's per-row marks of ended streams
    (``apply``; a byte per row, shared memory).
    """
    import signal

    from setproctitle import setproctitle

    from ringshm.transport.segment import exit_with_parent

    if spec.gpu is not None:  # before CUDA starts (torch starts it at the first CUDA call, not at import)
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.gpu)
    setproctitle(process_title(spec))
    exit_with_parent()  # a stage lives no longer than the engine or worker that started it (kill -9 included)
    # A stage belongs to its coordinator: it ends on SHUTDOWN, or when the coordinator (its ring peer) is
    # gone. Ctrl-C, SIGTERM or a terminal's SIGHUP sent to the whole process group must reach only the
    # coordinator, which then shuts the stages down in order instead of losing them mid-op.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # Threads are set before torch does any work: stages must not oversubscribe the cores (ringshm.runtime.launcher).
    import torch

    torch.set_num_threads(max(1, spec.cores // spec.n_stages))
    from ringshm.errors import PeerDied
    from ringshm.transport import messages as m
    from ringshm.transport.error_buffer import write_error
    from ringshm.transport.ring import Ring

    base = spec.index * N_SLOTS
    rin = Ring.attach(spec.in_ring, role="consumer")
    rout = Ring.attach(spec.out_ring, role="producer")
    code = 1
    try:
        try:
            model = _load(spec)
            model.reserve(spec.max_op_tokens)  # the layers' scratch, held from the start (check_memory counts it)
        except Exception as exc:  # report the stage's own error (shared buffer, then the ring), then exit
            if errors is not None:
                write_error(errors, spec.index, exc)
            status[base + SLOT_STATE] = FAILED
            _send(rout, m.Message(m.PING).error(exc, spec.index), spec.ring_timeout_s)
            return
        status[base + SLOT_STATE] = LOADED
        serve(model, spec, rin, rout, status, ended)
        code = 0  # SHUTDOWN
    except PeerDied:
        code = 0  # upstream or downstream is gone: nothing left to serve
    except BaseException as exc:  # the loop itself broke (e.g. a record its output ring can never hold): say why
        if errors is not None:
            write_error(errors, spec.index, exc)
    finally:
        status[base + SLOT_STATE] = EXITED
        rin.close()
        rout.close()
        os._exit(code)  # skip interpreter teardown (torch thread pools); the rings are closed


def _load(spec: StageSpec):
    import torch

    from ringshm.model import hugepages, qmatmul
    from ringshm.model.stage_model import StageModel

    device = "cuda:0" if spec.device == "cuda" else "cpu"  # CUDA_VISIBLE_DEVICES already picked the GPU
    if spec.row_prefetch is not None:
        qmatmul.set_row_prefetch(spec.row_prefetch)
    hugepages.set_huge_pages(spec.huge_pages)
    return StageModel.from_path(
        spec.model_path, (spec.layer_start, spec.layer_stop), is_first=spec.index == 0,
        is_last=spec.index == spec.n_stages - 1, max_rows=spec.max_rows, max_seq_len=spec.max_seq_len,
        block_size=spec.block_size, n_blocks=spec.n_blocks, kv_dtype=getattr(torch, spec.kv_dtype),
        dtype=getattr(torch, spec.dtype), device=device, activations=spec.matmul_activations)


def _send(ring, msg, timeout_s: float) -> None:
    """Encode ``msg`` straight into the ring and publish it."""
    from ringshm.transport import messages as m

    n = m.encoded_size(msg)
    m.encode_into(ring.reserve(n, timeout_s), msg)
    ring.commit(n)


def serve(model, spec: StageSpec, rin, rout, status, ended=None) -> None:
    """The loop: peek → decode (zero-copy) → apply (skipping what ``ended`` marks) → encode into the output ring
    → release.

    A STEP op with ``WANT_ALLOWED`` segments is followed by its MASKS record (``ringshm.transport.messages``): a
    stage before the last forwards it as it forwards every record; the last stage copies the op's tensors out,
    releases the op and reads the MASKS record behind it only once the LM head has the logits (``read_masks``), so
    the coordinator computes the masks while the layers run. A MASKS record the last stage meets here is one no
    op read (its op failed upstream, every constrained segment was skipped, or it came after ``read_masks`` gave
    up): dropped."""
    from ringshm.transport import messages as m

    base = spec.index * N_SLOTS
    is_last = spec.index == spec.n_stages - 1
    threads = ThreadPicker(spec, status)
    while True:
        view = rin.peek(timeout_s=None)  # no deadline: idle is fine; a dead upstream raises PeerDied
        msg = m.decode(view)
        m.hold_until_delivered(msg, spec.link_latency_ms)
        if msg.op == m.MASKS and is_last:
            del msg, view
            rin.release()
            continue
        t0 = time.perf_counter()
        released = False
        if msg.op in (m.ERROR, m.PING, m.SHUTDOWN, m.MASKS):
            out = msg if msg.op != m.PING or not is_last else msg.reply([])
        else:
            masks = None
            if is_last and msg.op == m.STEP and m.needs_masks(msg.segments):
                msg.tensors = [t.clone() for t in msg.tensors]  # the op's record goes: its MASKS record is next
                view = None
                rin.release()
                released = True
                masks = functools.partial(read_masks, rin, msg, spec.ring_timeout_s, spec.link_latency_ms)
            # Active before the threads are picked: two stages starting at once usually each see the other (and
            # split) rather than both taking every core.
            status[base + SLOT_ACTIVE] = 1.0
            try:
                threads.before_op(msg.n_tokens)
                out = apply(model, msg, is_last, spec.max_op_tokens, ended, masks)
            except Exception as exc:
                out = msg.error(exc, spec.index)
            finally:
                status[base + SLOT_ACTIVE] = 0.0
                threads.after_op()
        n = m.encoded_size(out)
        # No deadline: a full output ring is backpressure (the next stage is busy, or stopped and will be
        # reported stalled by the coordinator); a consumer that is gone raises PeerDied.
        m.encode_into(rout.reserve(n, None), out)
        # Busy time ends, and is counted, before the record is published: once it is, the next stage may
        # already compute, and the coordinator may read the counters as soon as it has the reply.
        status[base + SLOT_BUSY_S] += time.perf_counter() - t0
        if msg.op != m.MASKS:  # ops only: every stage's count stays comparable with the coordinator's (stall watch)
            status[base + SLOT_OPS] += 1
        rout.commit(n)
        stop = msg.op == m.SHUTDOWN
        del msg, out, view  # drop tensors that view the input record before releasing it
        if not released:
            rin.release()
        if stop:
            return


def read_masks(rin, op, timeout_s: float, link_latency_ms: float, kept: list[int]):
    """The last stage's read of the MASKS record behind STEP ``op`` (already released from ``rin``): the rows of
    segments ``kept`` (indices into ``op``'s table), int32 ``[Σ n_allowed_rows of those, ceil(vocab / 32)]``
    (``messages.mask_rows``). The record is released once read; a record that is not ``op``'s stays for the loop.

    Raises:
        RingTimeout: no record within ``timeout_s`` (the op fails; its MASKS record, if it comes, is dropped).
        PeerDied: the coordinator is gone. ProtocolError: the next record is not ``op``'s MASKS record.
    """
    from ringshm.transport import messages as m

    view = rin.peek(timeout_s=timeout_s)
    record = m.decode(view)
    m.hold_until_delivered(record, link_latency_ms)
    rows = m.mask_rows(record, op, kept)
    del record, view
    rin.release()
    return rows


def apply(model, msg, is_last: bool, max_op_tokens: int = 1 << 20, ended=None, masks=None):
    """Apply one op to ``model`` and build the message to send on (hidden states, or the reply).

    ``masks``: on the last stage, for an op with ``WANT_ALLOWED`` segments, a callable taking the indices of the
    segments computed and returning their bitmask rows (``read_masks`` over the ring; ``messages.mask_rows``),
    called once the logits are ready.

    ``ended``: the coordinator's per-row marks of streams that ended with ops in flight (a byte per row, shared
    memory; None: no marks on this host). A segment whose row is marked, or that an earlier stage marked
    ``SKIPPED``, is not computed (``ringshm.transport.messages``: ended streams are skipped); an op all of whose
    rows get marked while it runs stops at the next layer and goes on as skipped (``StageModel.step``'s
    ``abandoned``).

    Raises:
        ValueError / KVRangeError: a malformed op, a step op over ``max_op_tokens`` tokens, a bad segment
            table (sent back as an ERROR reply naming the segment), or (last stage) ``WANT_ALLOWED`` segments and
            no ``masks``.
    """
    import torch

    from ringshm.model.stage_model import OpAbandoned
    from ringshm.transport import messages as m

    if msg.op != m.STEP:
        raise ValueError(f"unknown op code {msg.op}")
    n_targets = sum(seg.n_targets() for seg in msg.segments)
    n_tensors = 2 + bool(n_targets)
    if len(msg.tensors) != n_tensors:
        raise ValueError(f"a step op carries its tokens{', its target ids' if n_targets else ''} and its block "
                         f"tables: {n_tensors} tensors, got {len(msg.tensors)}")
    if msg.n_tokens > max_op_tokens:
        raise ValueError(f"a step op of {msg.n_tokens} tokens is over the op budget of {max_op_tokens}")
    if is_last and masks is None and m.needs_masks(msg.segments):
        raise ValueError("the op restricts outputs (WANT_ALLOWED) and no MASKS record reaches the last stage")
    x, tables = msg.tensors[0], msg.tensors[-1]
    targets = msg.tensors[1] if n_targets else None
    if targets is not None and (targets.dtype != torch.int64 or targets.shape != (n_targets,)):
        raise ValueError(f"the op's targets must be int64 [{n_targets}], got {targets.dtype} {tuple(targets.shape)}")
    masks = masks if is_last else None
    segments = mark_ended(msg.segments, ended)
    if any(seg.want & m.SKIPPED for seg in segments):
        return _apply_skipping(model, msg, segments, x, targets, masks, tables, is_last)
    if model.device.type != "cpu":
        x = x.to(model.device)  # the one copy to the stage's device
    kw = {}
    if ended is not None:  # asked between layers: an op whose streams all end mid-op stops there
        rows = [seg.row for seg in segments]
        kw["abandoned"] = lambda: all(0 <= r < len(ended) and ended[r] for r in rows)
    if masks is not None:
        kw["allowed"] = functools.partial(masks, list(range(len(segments))))
    try:
        out = model.step(x, msg.segments, targets, tables, **kw)
    except OpAbandoned:
        return _apply_skipping(model, msg, mark_ended(segments, ended), x, targets, masks, tables, is_last)
    if not is_last:  # the targets and tables travel on unchanged to the last stage
        hidden = (out if out.device.type == "cpu" else out.cpu()).contiguous()
        return msg.forward([hidden] + ([] if targets is None else [targets]) + [tables])
    return msg.reply(out.tensors())


def mark_ended(segments: list, ended) -> list:
    """``segments`` with each one whose row ``ended`` marks turned ``SKIPPED`` (each mark read once here);
    ``ended`` None: unchanged."""
    from ringshm.transport import messages as m

    if ended is None:
        return segments
    n = len(ended)
    return [m.Segment(s.row, s.start, s.n_tokens, m.SKIPPED) if not s.want & m.SKIPPED and 0 <= s.row < n
            and ended[s.row] else s for s in segments]


def _apply_skipping(model, msg, segments: list, x, targets, masks, tables, is_last: bool):
    """``apply`` for an op with ``SKIPPED`` segments: the model runs on the others alone (their bytes are what they
    would be beside any batch-mates: batch invariance); the skipped ones write no KV, forward zero hidden states
    and no target ids, take no bitmask rows (``masks``, the last stage's: asked for the kept segments' only) and
    reply nothing. Returns the message to send on, its table ``segments``.

    Raises:
        ValueError: a skipped segment of < 1 token or a negative start, or block tables that do not fit the table.
    """
    import itertools

    import torch

    from ringshm.model.attention import table_len
    from ringshm.transport import messages as m

    for i, seg in enumerate(segments):
        if seg.n_tokens < 1 or seg.start < 0:
            raise ValueError(f"segment {i} (row {seg.row}): needs n_tokens >= 1 and start >= 0")
    tok = [0, *itertools.accumulate(s.n_tokens for s in segments)]
    tab = [0, *itertools.accumulate(table_len(s.start + s.n_tokens, model.block_size) for s in segments)]
    tgt = [0, *itertools.accumulate(s.n_targets() for s in msg.segments)]  # as the op arrived
    if tables.dtype != torch.int32 or tables.dim() != 1 or tables.numel() != tab[-1]:
        raise ValueError(f"the op's block tables must be int32 [{tab[-1]}], got {tables.dtype} {tuple(tables.shape)}")
    kept = [i for i, s in enumerate(segments) if not s.want & m.SKIPPED]
    sub_targets = _kept_rows(targets, tgt, kept)
    out = None
    if kept:
        sub_x = torch.cat([x[tok[i]:tok[i + 1]] for i in kept]).to(model.device)
        sub_tables = torch.cat([tables[tab[i]:tab[i + 1]] for i in kept])
        kw = {} if masks is None else {"allowed": functools.partial(masks, kept)}
        out = model.step(sub_x, [segments[i] for i in kept], sub_targets, sub_tables, **kw)
    if is_last:
        reply = msg.reply(out.tensors() if out is not None else [torch.zeros(0, dtype=torch.int64)])
        reply.segments = segments
        return reply
    hidden = torch.zeros(tok[-1], model.config.hidden, dtype=model.dtype)
    o = 0
    for i in kept:
        n = segments[i].n_tokens
        hidden[tok[i]:tok[i + 1]] = out[o:o + n]
        o += n
    fwd = msg.forward([hidden] + ([] if sub_targets is None else [sub_targets]) + [tables])
    fwd.segments = segments
    return fwd


def _kept_rows(t, offsets: list[int], kept: list[int]):
    """The rows ``offsets[i]:offsets[i + 1]`` of ``t`` for each kept segment i, concatenated; None when ``t`` is
    None or nothing is left."""
    import torch

    if t is None or not kept:
        return None
    sub = torch.cat([t[offsets[i]:offsets[i + 1]] for i in kept])
    return sub if sub.numel() else None
