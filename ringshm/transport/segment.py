"""POSIX shared-memory segments: create (mode 0600), attach, unlink, and sweep the ones whose creator died.

Names look like ``/ringshm-<pid>-<start>-<token>``: the creator's pid and its process start time (clock
ticks since boot, from ``/proc/<pid>/stat``), so a pid reused by an unrelated process is not taken for the
creator, and 16 random hex digits, so a name cannot be guessed. A node of a multi-host engine tags its names
with its node rank (``/ringshm.n1-…``): each host's segments are told apart by name, never by probing, which
also lets tests run several "hosts" on one machine. Linux only (``/proc`` and ``/dev/shm``).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

import posix_ipc

PREFIX = "ringshm"
SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(rf"^{PREFIX}(?:\.([a-z0-9]{{1,16}}))?-(\d+)-(\d+)-[0-9a-f]{{16}}$")
_TAG_RE = re.compile(r"^[a-z0-9]{0,16}$")


def process_start_time(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot, or None when it is gone or a zombie.

    Field 22 of ``/proc/<pid>/stat`` (proc(5)). A zombie (state Z or X) counts as gone: it has exited and
    only waits to be reaped, so it will never read or write a ring again.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X", b"x"):
        return None
    return int(fields[19])


def is_alive(pid: int, start_time: int = 0) -> bool:
    """Whether ``pid`` runs and, when ``start_time`` is non-zero, is the same process that started then."""
    if pid <= 0:
        return False
    started = process_start_time(pid)
    return started is not None and (start_time == 0 or started == start_time)


PARENT_GONE_EXIT = 1  # a child's exit status when it ended because the process that started it is gone


def exit_with_parent() -> None:
    """End this process as soon as the process that spawned it exits, however it exits (``kill -9`` included).

    For the children the engine and ``ringshm worker`` spawn (stages, bridges): a child whose ring peers are
    its siblings would otherwise outlive its parent and keep serving (a worker's stages and bridges kept the
    head's requests going for minutes after the worker was killed). A daemon thread waits on multiprocessing's
    parent sentinel (the read end of a pipe whose write end only the parent holds: end of file when it exits)
    and ends the process with ``os._exit(PARENT_GONE_EXIT)``; the parent's segments are not the child's to
    unlink. No-op outside a multiprocessing child.
    """
    import multiprocessing
    import multiprocessing.connection
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=wait, name="ringshm-parent-watch", daemon=True).start()


_SELF_START = process_start_time(os.getpid()) or 0


def self_start_time() -> int:
    """This process's start time (clock ticks since boot); re-read after a fork."""
    global _SELF_START
    if not _SELF_START or process_start_time(os.getpid()) != _SELF_START:
        _SELF_START = process_start_time(os.getpid()) or 0
    return _SELF_START


class Segment:
    """A mapped POSIX shared-memory segment.

    ``buf`` is an ``mmap`` of ``size_bytes``. The creator owns the name: ``unlink()`` removes it (other
    mappings stay valid until they close). Use ``Segment.create`` / ``Segment.attach``.
    """

    def __init__(self, name: str, buf: mmap.mmap, size_bytes: int, owner: bool):
        self.name = name
        self.buf = buf
        self.size_bytes = size_bytes
        self.owner = owner

    @classmethod
    def create(cls, size_bytes: int, tag: str = "") -> "Segment":
        """Create a zero-filled segment of ``size_bytes`` with mode 0600 and a fresh unguessable name
        (``tag``: the host tag in the name, e.g. "n1"; "" for none).

        The pages are allocated up front (``posix_fallocate``): a full ``/dev/shm`` fails here with
        ``OSError(ENOSPC)`` instead of killing a process with SIGBUS when it first touches a page.

        Raises:
            ValueError: size_bytes < 1, or a tag that is not 0-16 lowercase letters / digits.
            OSError: the system refused (e.g. /dev/shm full: errno ENOSPC, the message gives the sizes).
        """
        if size_bytes < 1:
            raise ValueError(f"segment size must be >= 1 byte, got {size_bytes}")
        if not _TAG_RE.match(tag):
            raise ValueError(f"a segment tag is 0-16 lowercase letters or digits, got {tag!r}")
        prefix = f"{PREFIX}.{tag}" if tag else PREFIX
        name = f"/{prefix}-{os.getpid()}-{self_start_time()}-{secrets.token_hex(8)}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size_bytes)
        try:
            try:
                os.posix_fallocate(shm.fd, 0, size_bytes)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot allocate {size_bytes / 2**20:.1f} MiB in {SHM_DIR} "
                              f"({shm_free_bytes() / 2**20:.1f} MiB free): {exc.strerror}") from None
            buf = mmap.mmap(shm.fd, size_bytes)
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        return cls(name, buf, size_bytes, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        """Map an existing segment by name (with or without the leading '/').

        Raises:
            FileNotFoundError: no segment of that name.
        """
        if not name.startswith("/"):
            name = "/" + name
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise FileNotFoundError(f"no shared-memory segment named {name!r}") from exc
        try:
            size_bytes = shm.size
            buf = mmap.mmap(shm.fd, size_bytes)
        finally:
            shm.close_fd()
        return cls(name, buf, size_bytes, owner=False)

    def close(self) -> bool:
        """Unmap. Returns False when a view into the mapping is still alive (the mapping then stays valid
        and is unmapped when the last view goes), True otherwise. Idempotent."""
        try:
            self.buf.close()
        except BufferError:
            return False
        return True

    def unlink(self) -> None:
        """Remove the name (creator only; a no-op for attachers and when already gone). Idempotent."""
        if not self.owner:
            return
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
        self.owner = False


def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still allocate in ``/dev/shm`` (statvfs ``f_bavail * f_frsize``)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def list_segments(tag: str | None = None) -> list[str]:
    """Names (with leading '/') of every ringshm segment on this host; with ``tag``, only those carrying that
    host tag ("" = untagged)."""
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        m = _NAME_RE.match(e)
        if m and (tag is None or (m.group(1) or "") == tag):
            out.append("/" + e)
    return sorted(out)


def creator_of(name: str) -> tuple[int, int] | None:
    """(pid, start_time) encoded in a ringshm segment name, or None for a foreign name."""
    m = _NAME_RE.match(name.lstrip("/"))
    return (int(m.group(2)), int(m.group(3))) if m else None


def sweep_stale() -> list[str]:
    """Unlink every ringshm segment whose creator process is gone (or is a different process now that
    reuses its pid). Returns the names removed. Safe to run while other ringshm processes work: segments
    of live creators are left alone."""
    removed = []
    for name in list_segments():
        pid, start = creator_of(name)
        if is_alive(pid, start):
            continue
        try:
            posix_ipc.unlink_shared_memory(name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass
    return removed
