"""Every op and tag on the wire, and the record codec. No pickle: a fixed binary header, a segment table,
tensor descriptors, then raw tensor bytes written straight into the ring record and read back zero-copy.

Record layout (little-endian, every section 8-byte aligned):

    +--------------------------------------------------------------------------------------------+
    | header (HEADER.size = 48 bytes)                                                            |
    |   magic u16 | version u8 | op u8 | flags u16 | n_tensors u8 | pad u8                       |
    |   job u32 | n_segments i32 | seq u64 | n_tokens i64 (T, the tokens of all segments)        |
    |   aux i64 | sent_ns u64 (CLOCK_MONOTONIC when the sender encoded it; drives link latency)  |
    +--------------------------------------------------------------------------------------------+
    | segment table: n_segments x (row i32, start i32, n_tokens i32, want u32)                   |
    +--------------------------------------------------------------------------------------------+
    | tensor descriptors: n_tensors x (dtype u8, ndim u8, pad u16, shape 4 x i32, nbytes u64)    |
    +--------------------------------------------------------------------------------------------+
    | tensor bytes, each starting on a 64-byte boundary of the record                            |
    +--------------------------------------------------------------------------------------------+

The one compute op is ``STEP``: a segment is ``n_tokens`` consecutive positions of one stream (its ``row``, a
coordinator slot) from ``start`` (a decode is a 1-token segment, a speculative verify k+1 tokens, a prefill
chunk n tokens; one op may mix them, a row at most once). Its tensors, in this order:

    x        every segment's tokens in table order: int64 ids [T] into stage 0, fp32 hidden states
             [T, hidden] between stages (HIDDEN set)
    targets  only when a segment has WANT_PROMPT_LOGPROBS: int64 [Σ n_targets], the token that follows each of
             those positions (the prompt's next id), in table order; every stage forwards it unchanged, so the
             last stage, which never sees ids, can score them
    tables   int32 [Σ ceil((start + n_tokens) / B)]: each segment's KV block table (its stream's blocks in
             position order, B the engine's block size), in table order; every stage forwards it unchanged

The coordinator owns the tables (ringshm.engine.kv_blocks); a table covers exactly the positions the segment
reaches, so its length follows from the segment and needs no field of its own.

**Masks travel behind their op.** A STEP op with a ``WANT_ALLOWED`` segment (a constrained stream: structured
output) is followed in the same ring, directly, by one ``MASKS`` record: the op's seq, the op's segment table as
the coordinator sent it, and one tensor

    allowed  int32 [Σ n_allowed_rows over that table, ceil(vocab / 32)]: one packed bitmask per output position of
             each WANT_ALLOWED segment, in table order (token t allowed iff bit t % 32 of word t // 32 is set:
             llguidance's layout), built by the coordinator from each stream's grammar

The coordinator sends the op first and computes the masks while the stages run it: a mask depends on the
stream's newest token, so computed before the op it would sit between a reply and the next op, with every stage
idle (16 constrained streams: ~0.6 ms a step). Every stage but the last forwards a MASKS record unchanged, in
order; the last stage reads it once its LM head has the op's logits (``ringshm.runtime.stage``), takes the rows of
the segments it computes (by the record's own table, so segments skipped on the way change nothing) and the
argmax of those positions among the allowed tokens only. A MASKS record the last stage meets between ops (its op
failed upstream, every constrained segment of it was skipped, or it came after its op gave up waiting for it) is
dropped. Nothing else is sent between an op
and its MASKS record (``ringshm.engine.coordinator.Link``).

``want`` (u32) says what the last stage returns for the segment:

    bits 0-2   WANT_LAST (1): argmax at the last position; WANT_ALL (2): argmax at every position;
               WANT_LOGITS (4, with LAST): also that position's fp32 logits [vocab] (the coordinator samples)
    bit 3      WANT_LOGPROBS (with LAST or ALL): log-softmax at each output position: the argmax's logprob
               and the top-k ids and logprobs
    bit 4      WANT_PROMPT_LOGPROBS (not with ALL): log-softmax at each position that has a target: the
               target's logprob and the top-k; that is every position, or all but the last with WANT_LAST
               (the last position's next token is the one being generated)
    bit 5      WANT_ALLOWED (with LAST or ALL, not with LOGITS): the argmax at each output position is taken over
               the tokens its row of the MASKS record behind the op permits (a constrained stream: structured
               output); logprobs stay the raw model's (the chosen id is the masked argmax)
    bits 8-15  k, the top-k count (0 .. MAX_TOP_LOGPROBS) of both logprob kinds; 0 unless one is set
    bit 16     SKIPPED: set by a stage, never by the coordinator (which sends bits 16-31 zero): the segment's stream
               ended (cancelled, failed or finished) while the op was in flight, so no stage computes it (see
               below); the segment then wants nothing else (its other bits are cleared)
    bits 17-31 zero

**Ended streams are skipped.** The coordinator marks the row of a stream that ends with ops still in flight in
a byte array shared with the stages of its host (``ended``, one byte per row, cleared when the row is given to
the next stream, which only happens once no op of the old one is in flight). A stage that takes an op reads the
mark of each segment's row once; a marked segment is not computed: no KV is written for it, its rows of the
hidden states go on as zeros, its target ids are dropped, and the table the stage forwards carries it as
``SKIPPED``, so every later stage (another host's too) skips it as well. The reply's table is the op's with
those segments ``SKIPPED``; the coordinator accepts exactly that difference (``same_table``), and commits nothing
of such a stream after it marked it (its KV may be missing at any stage from then on, so none of it may enter
the prefix cache). A client that goes away thus costs at most the ops a stage had already begun.

Reply tensors, in this order, each only when some segment asks for it:

    ids          int64 [Σ n_outputs]           nothing for WANT_NONE, 1 for WANT_LAST, n_tokens for WANT_ALL
    logits       fp32  [n_logit_segments, V]    the last position of each WANT_LOGITS segment
    lp_chosen    fp32  [P]                      P = Σ n_logprob_positions: per segment, first its target
                                                positions, then its output positions (table order)
    lp_top_ids   int64 [Σ k over the P]         each position's top-k ids, most likely first
    lp_top       fp32  [Σ k over the P]         their logprobs

Logprobs are fp32 log-softmax of the fp32 logits, computed row by row (a row's bits do not depend on the
other rows of the op: batch invariance); the whole vocabulary never crosses the ring for them.

A reply repeats the op's job, seq and segment table with ``flags | REPLY``; an error reply has ``op = ERROR``,
``aux`` = the failing stage, and one uint8 tensor holding ``"<ExceptionName>: <message>"`` in UTF-8.
"""

from __future__ import annotations

import itertools
import struct
import time
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ringshm.generation_params import MAX_TOP_LOGPROBS

# ---------------------------------------------------------------------------------------------- op codes
STEP = 2  # the compute op: a segment table and one tensor (see the module docstring)
MASKS = 3  # the allowed-token bitmasks of the STEP op just before it (same seq; module docstring)
SHUTDOWN = 5  # the stage forwards it and exits its loop
PING = 6  # startup / liveness: every stage forwards it; reply carries nothing
ERROR = 0x7F  # a stage failed an op: payload names the exception

OP_NAMES = {STEP: "step", MASKS: "masks", SHUTDOWN: "shutdown", PING: "ping", ERROR: "error"}

# ------------------------------------------------------------------------------------------------- flags
REPLY = 1 << 0  # set by the last stage on what it sends back to the coordinator
HIDDEN = 1 << 3  # the tensor is hidden states (between stages), not token ids

# ---------------------------------------------------------------------------------- what a segment wants
WANT_NONE = 0  # nothing (a prefill chunk that is not the prompt's last)
WANT_LAST = 1  # the argmax at the segment's last position (decode, a prompt's last chunk)
WANT_ALL = 2  # the argmax at every position (speculative verify)
WANT_LOGITS = 4  # with WANT_LAST: also the last position's fp32 logits (sampling)
WANT_LOGPROBS = 8  # with LAST / ALL: the output positions' logprobs and top-k (module docstring)
WANT_PROMPT_LOGPROBS = 16  # the logprob of each position's target (the next prompt id) and the top-k
WANT_ALLOWED = 32  # with LAST / ALL: the MASKS record behind the op restricts each output position's argmax
WANT_K_SHIFT = 8  # bits 8-15: k, the top-k count of either logprob kind
WANT_VALID = (WANT_LAST | WANT_ALL | WANT_LOGITS | WANT_LOGPROBS | WANT_PROMPT_LOGPROBS | WANT_ALLOWED
              | (0xFF << WANT_K_SHIFT))  # every bit a coordinator may set
SKIPPED = 1 << 16  # set by a stage: the segment's stream ended, no stage computes it (module docstring)


def want_k(k: int) -> int:
    """The ``want`` bits carrying a top-k count ``k`` (0 .. ``MAX_TOP_LOGPROBS``)."""
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top-k count must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    return k << WANT_K_SHIFT

MAGIC = 0x5352  # "RS"
VERSION = 7  # the record layout above; a record of another version is refused (ProtocolError)
HEADER = struct.Struct("<HBBHBxIiQqqQ")
SEGMENT = struct.Struct("<iiiI")
TENSOR_DESC = struct.Struct("<BBxx4iQ")
TENSOR_ALIGN = 64
MAX_NDIM = 4
MAX_TENSORS = 8

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8]
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}

# A ring record is read-only; tensors over it are only ever copied from, never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class ProtocolError(ValueError):
    """A record that does not decode: bad magic or version, or sizes that disagree with the record."""


class Segment(NamedTuple):
    """One entry of a STEP op's segment table: ``n_tokens`` positions of row ``row`` from ``start``, and
    what the last stage returns for it (``WANT_*``)."""

    row: int
    start: int
    n_tokens: int
    want: int = WANT_NONE

    def n_outputs(self) -> int:
        """Argmax ids the reply carries for this segment."""
        return self.n_tokens if self.want & WANT_ALL else 1 if self.want & WANT_LAST else 0

    @property
    def k(self) -> int:
        """The top-k count of its logprobs (bits 8-15 of ``want``)."""
        return (self.want >> WANT_K_SHIFT) & 0xFF

    def n_targets(self) -> int:
        """Target ids the op's ``targets`` tensor holds for this segment (``WANT_PROMPT_LOGPROBS``): one per
        position, but none for the last when it also generates (``WANT_LAST``)."""
        if not self.want & WANT_PROMPT_LOGPROBS:
            return 0
        return self.n_tokens - 1 if self.want & WANT_LAST else self.n_tokens

    def n_allowed_rows(self) -> int:
        """Bitmask rows the op's ``allowed`` tensor holds for this segment: one per output (``WANT_ALLOWED``)."""
        return self.n_outputs() if self.want & WANT_ALLOWED else 0

    def n_logprob_positions(self) -> int:
        """Positions the reply carries logprobs (and top-k) for: its targets, then its outputs."""
        return self.n_targets() + (self.n_outputs() if self.want & WANT_LOGPROBS else 0)


def same_table(sent: list[Segment], got: list[Segment]) -> bool:
    """Whether a reply's segment table answers the op's: equal, except that a segment may come back
    ``SKIPPED`` (its stream ended while the op was in flight; module docstring)."""
    return len(sent) == len(got) and all(
        a == b or (b.want == SKIPPED and a[:3] == b[:3]) for a, b in zip(sent, got))


def needs_masks(segments: list[Segment]) -> bool:
    """Whether a STEP op with this table is followed by a MASKS record (a segment has ``WANT_ALLOWED``)."""
    return any(seg.want & WANT_ALLOWED for seg in segments)


def masks_record(op: "Message", allowed: torch.Tensor) -> "Message":
    """The MASKS record that follows ``op``: its job, seq and table, and ``allowed`` (int32 ``[Σ n_allowed_rows,
    ceil(vocab / 32)]``, module docstring).

    Raises:
        ValueError: ``allowed`` is not int32 2-d with one row per output position of ``op``'s ``WANT_ALLOWED``
            segments.
    """
    n = sum(seg.n_allowed_rows() for seg in op.segments)
    if allowed.dtype != torch.int32 or allowed.dim() != 2 or allowed.shape[0] != n:
        raise ValueError(f"the masks of op {op.seq} must be int32 [{n}, ceil(vocab / 32)], got {allowed.dtype} "
                         f"{tuple(allowed.shape)}")
    return Message(MASKS, op.job, op.seq, segments=op.segments, tensors=[allowed])


def mask_rows(record: "Message", op: "Message", kept: list[int]) -> torch.Tensor:
    """The rows of MASKS ``record`` for segments ``kept`` (indices into ``op``'s table) of STEP ``op``, in table
    order: int32 ``[Σ n_allowed_rows of those segments, ceil(vocab / 32)]`` (a copy). Rows are found by the record's
    own table (what the coordinator sent), so segments skipped on the way do not shift them.

    Raises:
        ProtocolError: ``record`` is not the MASKS record of ``op`` (another op code or seq, a table of other
            positions, not one int32 row per output position of its ``WANT_ALLOWED`` segments).
    """
    if record.op != MASKS or record.seq != op.seq or len(record.segments) != len(op.segments) or any(
            a[:3] != b[:3] for a, b in zip(record.segments, op.segments)):
        raise ProtocolError(f"op {op.seq} wants its MASKS record next, got {OP_NAMES.get(record.op, record.op)} "
                            f"seq {record.seq} with {len(record.segments)} segments")
    offs = [0, *itertools.accumulate(seg.n_allowed_rows() for seg in record.segments)]
    allowed = record.tensors[0] if len(record.tensors) == 1 else None
    if allowed is None or allowed.dtype != torch.int32 or allowed.dim() != 2 or allowed.shape[0] != offs[-1]:
        got = "no single tensor" if allowed is None else f"{allowed.dtype} {tuple(allowed.shape)}"
        raise ProtocolError(f"the MASKS record of op {op.seq} must hold int32 [{offs[-1]}, ceil(vocab / 32)], "
                            f"got {got}")
    return torch.cat([allowed[offs[i]:offs[i + 1]] for i in kept]) if kept else allowed[:0].clone()


def _align(n: int, a: int = 8) -> int:
    return (n + a - 1) // a * a


@dataclass
class Message:
    """One op or reply. ``segments``: the segment table (``Segment`` tuples).

    ``tensors``: CPU tensors to send, or (decoded) zero-copy views over the ring record that are valid
    only until the record is released: copy what you keep.
    """

    op: int
    job: int = 0
    seq: int = 0
    flags: int = 0
    aux: int = 0  # op-specific integer (the stage index of an error)
    segments: list[Segment] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    sent_ns: int = 0  # set by encode_into; read back by decode

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & REPLY)

    @property
    def n_tokens(self) -> int:
        """T: the tokens of every segment."""
        return sum(s.n_tokens for s in self.segments)

    def reply(self, tensors: list[torch.Tensor], flags: int = 0) -> "Message":
        """A reply to this op: same job/seq/segments, ``REPLY`` set."""
        return Message(self.op, self.job, self.seq, (self.flags & ~HIDDEN) | REPLY | flags, self.aux,
                       self.segments, tensors)

    def forward(self, tensors: list[torch.Tensor]) -> "Message":
        """This op for the next stage, carrying ``tensors`` (hidden states) instead of its own."""
        return Message(self.op, self.job, self.seq, self.flags | HIDDEN, self.aux, self.segments, tensors)

    def error(self, exc: BaseException, stage: int) -> "Message":
        """An error reply naming ``exc`` (class and message) and the stage that raised it (in ``aux``)."""
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
        payload = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.zeros(0, dtype=torch.uint8)
        return Message(ERROR, self.job, self.seq, self.flags | REPLY, stage, self.segments, [payload])

    def error_text(self) -> str:
        """The ``"<ExceptionName>: <message>"`` of an ERROR message."""
        return bytes(self.tensors[0].numpy()).decode("utf-8", "replace") if self.tensors else ""


def _layout(msg: Message) -> tuple[int, list[int]]:
    """Total record bytes and the offset of each tensor's bytes."""
    off = HEADER.size + _align(SEGMENT.size * len(msg.segments)) + TENSOR_DESC.size * len(msg.tensors)
    offsets = []
    for t in msg.tensors:
        off = _align(off, TENSOR_ALIGN)
        offsets.append(off)
        off += t.numel() * t.element_size()
    return off, offsets


def encoded_size(msg: Message) -> int:
    """Bytes ``encode_into`` writes for ``msg``."""
    return _layout(msg)[0]


def encode_into(buf: memoryview, msg: Message) -> int:
    """Write ``msg`` into ``buf`` (e.g. a view from ``Ring.reserve``); returns the bytes written.

    Tensors must be CPU and contiguous (the caller moves device tensors to the host once).

    Raises:
        ValueError: too many tensors or dims, an unsupported dtype, a non-contiguous or non-CPU tensor,
            or ``buf`` too small.
    """
    if len(msg.tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensors per record, got {len(msg.tensors)}")
    total, offsets = _layout(msg)
    if len(buf) < total:
        raise ValueError(f"buffer of {len(buf)} bytes cannot hold a {total}-byte record")
    HEADER.pack_into(buf, 0, MAGIC, VERSION, msg.op, msg.flags, len(msg.tensors), msg.job, len(msg.segments),
                     msg.seq, msg.n_tokens, msg.aux, time.monotonic_ns())
    off = HEADER.size
    for seg in msg.segments:
        SEGMENT.pack_into(buf, off, *seg)
        off += SEGMENT.size
    off = HEADER.size + _align(SEGMENT.size * len(msg.segments))
    for t in msg.tensors:
        if t.dim() > MAX_NDIM or t.dtype not in _DTYPE_CODE:
            raise ValueError(f"cannot send a {t.dim()}-d {t.dtype} tensor (at most {MAX_NDIM} dims of "
                             f"{[str(d) for d in _DTYPES]})")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("tensors on the wire must be contiguous CPU tensors; call .contiguous().cpu()")
        shape = list(t.shape) + [0] * (MAX_NDIM - t.dim())
        TENSOR_DESC.pack_into(buf, off, _DTYPE_CODE[t.dtype], t.dim(), *shape, t.numel() * t.element_size())
        off += TENSOR_DESC.size
    for t, o in zip(msg.tensors, offsets):
        nbytes = t.numel() * t.element_size()
        if nbytes:
            dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=o)
            dst.copy_(t.reshape(-1).view(torch.uint8))
    return total


def encode(msg: Message) -> bytearray:
    """``msg`` as a new bytearray (for ``Ring.try_send``; the hot path encodes into ``Ring.reserve``)."""
    buf = bytearray(encoded_size(msg))
    encode_into(memoryview(buf), msg)
    return buf


def decode(buf: memoryview) -> Message:
    """Parse a record; tensors are zero-copy views over ``buf`` (valid until it is released).

    Raises:
        ProtocolError: bad magic/version, or a segment table / tensor that runs past the record, or a
            segment table whose token count disagrees with the header's.
    """
    if len(buf) < HEADER.size:
        raise ProtocolError(f"record of {len(buf)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, op, flags, n_tensors, job, n_seg, seq, n_tokens, aux, sent_ns = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"record magic/version {magic:#x}/{version}, expected {MAGIC:#x}/{VERSION}")
    if n_seg < 0 or n_tensors > MAX_TENSORS:
        raise ProtocolError(f"record claims {n_seg} segments and {n_tensors} tensors")
    desc_off = HEADER.size + _align(SEGMENT.size * n_seg)
    if desc_off + TENSOR_DESC.size * n_tensors > len(buf):
        raise ProtocolError("segment table or tensor descriptors run past the record")
    segments = [Segment._make(e) for e in SEGMENT.iter_unpack(buf[HEADER.size: HEADER.size + SEGMENT.size * n_seg])]
    if sum(seg.n_tokens for seg in segments) != n_tokens:
        raise ProtocolError(f"segment table holds {sum(seg.n_tokens for seg in segments)} tokens, the header "
                            f"says {n_tokens}")
    tensors = []
    off = desc_off + TENSOR_DESC.size * n_tensors
    for i in range(n_tensors):
        code, ndim, s0, s1, s2, s3, nbytes = TENSOR_DESC.unpack_from(buf, desc_off + i * TENSOR_DESC.size)
        if code >= len(_DTYPES) or ndim > MAX_NDIM:
            raise ProtocolError(f"tensor {i}: dtype code {code}, {ndim} dims")
        dtype, shape = _DTYPES[code], (s0, s1, s2, s3)[:ndim]
        off = _align(off, TENSOR_ALIGN)
        numel = 1
        for d in shape:
            numel *= d
        if min(shape, default=0) < 0 or numel * dtype.itemsize != nbytes or off + nbytes > len(buf):
            raise ProtocolError(f"tensor {i}: shape {shape} of {dtype} does not match {nbytes} bytes "
                                f"at offset {off} of a {len(buf)}-byte record")
        t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=off) if numel else torch.empty(0, dtype=dtype)
        tensors.append(t.view(shape))
        off += nbytes
    return Message(op, job, seq, flags, aux, segments, tensors, sent_ns)


def hold_until_delivered(msg: Message, link_latency_ms: float) -> None:
    """Simulated link latency: sleep until ``msg.sent_ns + link_latency_ms``. The receiver of each hop calls
    this before applying a record, so the delay of a record overlaps whatever the receiver was still doing
    (a link of that latency and unbounded bandwidth), and never blocks the sender."""
    if link_latency_ms > 0:
        wait_s = (msg.sent_ns + link_latency_ms * 1e6 - time.monotonic_ns()) / 1e9
        if wait_s > 0:
            time.sleep(wait_s)
