"""The exception tree, and the one place where a C status code becomes an exception (``check_status``: the ring's,
the kernels' and the matmul's codes).

Each exception is also the builtin a caller would naturally catch (PyNaCl's pattern): a ring timeout is a
``TimeoutError``, a dead peer a ``BrokenPipeError``, an oversize record a ``ValueError``.
"""

from __future__ import annotations


class RingshmError(Exception):
    """Base of every error ringshm raises on purpose."""


class RingTimeout(RingshmError, TimeoutError):
    """A blocking ring call ran past its ``timeout_s`` with the peer still alive."""


class PeerDied(RingshmError, BrokenPipeError):
    """The process on the other side of a ring is gone, or it closed the ring."""


class RingCorrupt(RingshmError, RuntimeError):
    """An index or record header read from shared memory fails its bounds checks.

    Raised instead of touching memory outside the ring; the ring cannot be trusted afterwards.
    """


class RecordTooLarge(RingshmError, ValueError):
    """A record can never fit in this ring, however long the caller waits."""


class SegmentMismatch(RingshmError, ValueError):
    """A segment's header (magic, layout version, capacity) is not what this build of ringshm expects."""


class RoleTaken(RingshmError, RuntimeError):
    """Another live process already holds this side (producer or consumer) of a single-producer ring."""


class RingStateError(RingshmError, RuntimeError):
    """A two-phase call out of order: commit without reserve, release without peek, use after close."""


# C status codes, mirrored from csrc/ring.h (enum ringshm_status).
OK = 0
WOULD_BLOCK = 1
ERR_TOO_BIG = -1
ERR_CORRUPT = -2
ERR_BAD_MAGIC = -3
ERR_BAD_VERSION = -4
ERR_BAD_CAPACITY = -5
ERR_STATE = -6
ERR_PEER_CLOSED = -7

# Model side: loading a checkpoint and addressing the KV cache (ringshm/model/loader.py, ringshm/model/stage_model.py).


class InvalidParameter(RingshmError, ValueError):
    """A request parameter out of range; ``param`` names it (the server's 400 says which field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnsupportedArchitecture(RingshmError, ValueError):
    """A checkpoint describes a model ringshm does not compute (another architecture, or a setting or tensor that
    would change the math); the message names the field."""

    @classmethod
    def setting(cls, where: str, field: str, value, why: str = "") -> UnsupportedArchitecture:
        """``<where>: <field> = <value> is not supported (<why>)``: one setting refused by name."""
        return cls(f"{where}: {field} = {value!r} is not supported" + (f" ({why})" if why else ""))


class InvalidCheckpoint(RingshmError, ValueError):
    """A model file (GGUF, or an HF directory's ``config.json`` / ``*.safetensors``) breaks a rule the checkpoint
    check holds it to (``ringshm.model.checkpoint_check``: a value's type or range, a count or length the file
    cannot hold, a tensor's type, shape or byte range); raised before any stage starts. The message is one line
    naming the file, the key or tensor, the value found and what was expected."""


class MissingTensor(InvalidCheckpoint):
    """A tensor the model needs is absent from the checkpoint; the message names it and the file."""


class MissingChatTemplate(RingshmError, ValueError):
    """Chat was asked of a model whose checkpoint carries no chat template (a base model such as Gemma 3 270M's
    pretrained file): give a plain prompt, or a checkpoint with a template."""


class UnsupportedQuantType(RingshmError, ValueError):
    """A GGUF tensor is stored in a quantization type ringshm cannot dequantize."""


class LayerRangeError(RingshmError, ValueError):
    """A stage's layer range is empty or lies outside ``[0, n_layers)`` of the model."""


class KVRangeError(RingshmError, ValueError):
    """An op would read KV positions a row has not written, or write past ``max_seq_len``; nothing changed."""


# ------------------------------------------------------------------------------------------ engine errors
class StageDied(PeerDied):
    """A stage process is gone (killed, crashed). ``stage`` is its index, ``exitcode`` its exit status
    (negative: the signal that killed it)."""

    def __init__(self, message: str, stage: int = -1, exitcode: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.exitcode = exitcode


class StageError(RingshmError, RuntimeError):
    """A stage failed an op and answered with an error reply; the engine stays usable.

    ``stage``: the index of the stage that raised; ``remote_type``: the exception's class name there;
    ``tag``: the coordinator's tag of the failed op (which request it served), when raised by ``Link.recv``.
    """

    def __init__(self, message: str, stage: int = -1, remote_type: str = ""):
        super().__init__(message)
        self.stage = stage
        self.remote_type = remote_type
        self.tag = None


class StageStartupError(StageError):
    """A stage could not start (e.g. its weights failed to load); the message is the stage's own error."""


class KVCacheOverflow(StageError, ValueError):
    """An op would write or read KV positions a stage's cache does not have (``KVRangeError`` there)."""


class ClusterRefused(RingshmError, ConnectionRefusedError):
    """A node refused another (wire version, model fingerprint, token, node rank) or never showed up
    (``ringshm.transport.cluster``); the message names the node and the reason."""


class EdgeError(RingshmError, ConnectionError):
    """An edge between hosts broke (``ringshm.transport.bridge``): the peer closed it or went silent, or sent something
    that breaks the wire."""


class EngineOwned(RingshmError, RuntimeError):
    """The engine is owned by an ``AsyncEngine`` (its dispatcher thread drives the ring): call the
    ``AsyncEngine``'s ``stream`` / ``complete`` instead, or ``close()`` it first."""


class ResourceShortage(RingshmError, RuntimeError):
    """Not enough shared memory (``/dev/shm``) or memory for what the engine was asked to hold; raised before
    any stage starts. The message gives the numbers and what to change."""


# ------------------------------------------------------------------------------------------ serving errors
class QueueFull(RingshmError, RuntimeError):
    """``max_rows`` requests run and ``max_waiting`` more wait for a row and its KV blocks: try again later (HTTP
    429)."""


class QueueTimeout(RingshmError, TimeoutError):
    """A request waited longer than ``max_queue_wait_s`` for a row and its KV blocks and was dropped unstarted (HTTP
    503)."""


class StageStalled(RingshmError, TimeoutError):
    """A stage has held an op longer than ``op_timeout_s`` (stopped, or stuck); ``stage`` is its index.
    Open requests fail with it and new ones are refused until the stage answers again (HTTP 503)."""

    def __init__(self, message: str, stage: int = -1):
        super().__init__(message)
        self.stage = stage


class EngineClosed(RingshmError, RuntimeError):
    """The ``AsyncEngine`` is shutting down or closed: no new request, and open ones end with this."""


class DispatcherFailed(EngineClosed):
    """The ``AsyncEngine``'s dispatcher thread stopped on an error of its own (not a stage's: those fail only the
    open requests): every open and queued request ends with this, and every new one is refused with it. The
    engine cannot serve again: close it and start a new one (``ringshm serve`` exits with status 3 for its
    supervisor)."""


class RequestFailed(RingshmError, RuntimeError):
    """A stage failed an op (or a reply did not match) while this request was open; ``__cause__`` is the
    original error. The engine stays usable."""


class ReplyMismatch(RingshmError, RuntimeError):
    """A reply does not answer the op the coordinator expects next (row, sequence number or op differ):
    replies must come back in send order, and a mismatch is raised rather than mis-assigned."""


# ------------------------------------------------------------------------ C status codes -> exceptions
class KernelError(RingshmError, ValueError):
    """A C kernel (csrc/kernels.h, matmul.h, layer.h) refused its arguments before it wrote anything: a shape, a
    tensor's length, a weight type or overlapping buffers. The Python wrappers and the checkpoint check run first,
    so this is a bug, or a malformed tensor that reached a kernel anyway; the message says what was refused."""


# mirrored from csrc/kernels.h (enum ringshm_kernel_status) and csrc/matmul.h (enum ringshm_matmul_status)
KERNEL_ERR_SHAPE = -16
KERNEL_ERR_RANGE = -17
KERNEL_ERR_LENGTH = -18
MATMUL_ERR_TYPE = -32
MATMUL_ERR_SHAPE = -33
MATMUL_ERR_SIZE = -34
MATMUL_ERR_ALIAS = -35

_STATUS = {
    ERR_TOO_BIG: (RecordTooLarge, "record larger than the ring can ever hold"),
    ERR_CORRUPT: (RingCorrupt, "ring index or record header out of bounds (corrupted shared memory)"),
    ERR_BAD_MAGIC: (SegmentMismatch, "bad magic: not a ringshm ring"),
    ERR_BAD_VERSION: (SegmentMismatch, "ring layout version differs from this build's"),
    ERR_BAD_CAPACITY: (SegmentMismatch, "capacity in the header is not a power of two that fits the segment"),
    ERR_STATE: (RingStateError, "two-phase call out of order"),
    ERR_PEER_CLOSED: (PeerDied, "the peer closed the ring"),
    KERNEL_ERR_SHAPE: (KernelError, "bad shape (a dimension <= 0, head_dim not a multiple of 16 or too large, or Hq "
                                    "not a multiple of Hkv)"),
    KERNEL_ERR_RANGE: (KVRangeError, "positions out of range (past the RoPE tables), a block id outside the pool, a "
                                     "block table too short for its positions, or KV read before it was written"),
    KERNEL_ERR_LENGTH: (KernelError, "a tensor's length is not what the shape reads from it (a norm of fewer than "
                                     "hidden floats, a bias of another width, RoPE tables of another size)"),
    MATMUL_ERR_TYPE: (KernelError, "unknown weight type, or an ISA this CPU cannot run"),
    MATMUL_ERR_SHAPE: (KernelError, "bad shape (M, N or K <= 0, K not a multiple of the block (32; 256 for the "
                                    "K-quants), or an output row stride below 16 * ceil(N / 16))"),
    MATMUL_ERR_SIZE: (KernelError, "a buffer's size does not match the shape (the packed weight, or a bias of "
                                   "another length than N)"),
    MATMUL_ERR_ALIAS: (KernelError, "the output overlaps x or the residual"),
}


def check_status(status: int, context: str = "") -> int:
    """Return ``status`` when it is ``OK`` or ``WOULD_BLOCK`` (>= 0); raise the matching exception otherwise.

    Raises:
        RecordTooLarge, RingCorrupt, SegmentMismatch, RingStateError, PeerDied: ring codes (csrc/ring.h).
        KVRangeError: RINGSHM_KERNEL_ERR_RANGE. KernelError: the other kernel and matmul codes.
        RingshmError: an unknown code (a build mismatch between Python and C).
    """
    if status >= 0:
        return status
    cls, what = _STATUS.get(status, (RingshmError, f"unknown C status {status}"))
    raise cls(f"{context}: {what}" if context else what)
