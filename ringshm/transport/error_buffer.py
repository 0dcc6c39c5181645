"""The shared error buffer: one fixed slot per process (stage or bridge) where it leaves the reason it failed,
read by the process that started it. A ``multiprocessing.Array`` of bytes, ``ERROR_BYTES`` per slot; the text
is "<type>: <message>", UTF-8, NUL-terminated. The writer always writes its slot before it reports the failure
any other way (a state flag, a ring record, its exit), so the reader never sees a failure without its reason.
"""

from __future__ import annotations

ERROR_BYTES = 2048  # per slot: "<type>: <message>", UTF-8, NUL-padded


def write_error(errors, index: int, exc: BaseException) -> None:
    """Put ``exc`` as "<type>: <message>" into slot ``index`` of the shared error buffer (cut to fit)."""
    data = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[: ERROR_BYTES - 1]
    errors[index * ERROR_BYTES: index * ERROR_BYTES + len(data) + 1] = data + b"\0"


def read_error(errors, index: int) -> str:
    """Slot ``index``'s error text from the shared buffer ("" if nothing was written there)."""
    raw = bytes(errors[index * ERROR_BYTES: (index + 1) * ERROR_BYTES])
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")
