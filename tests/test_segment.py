"""Unit tests of ``ringshm.transport.segment``: names, permissions, attach/unlink, liveness by pid and start time,
and ``sweep_stale`` on segments whose names encode a dead or reused creator. Process-killing cycles are
in test_ring_processes.py."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time

import posix_ipc
import pytest

from ringshm.transport.segment import (
    SHM_DIR,
    Segment,
    creator_of,
    is_alive,
    list_segments,
    process_start_time,
    sweep_stale,
)

pytestmark = pytest.mark.usefixtures("no_segment_left_behind")


@pytest.fixture
def segment():
    seg = Segment.create(4096)
    yield seg
    seg.close()
    seg.unlink()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a child process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _raw_segment(name: str) -> None:
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=64).close_fd()


def _unlink_quietly(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


# ------------------------------------------------------------------------------------------ create / attach
def test_created_segment_is_mode_0600_zero_filled_and_of_the_asked_size(segment):
    st = os.stat(SHM_DIR / segment.name.lstrip("/"))
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == segment.size_bytes == 4096
    assert segment.buf[:] == bytes(4096)


def test_segment_name_carries_the_creator_pid_and_start_time_and_an_unguessable_token(segment):
    assert creator_of(segment.name) == (os.getpid(), process_start_time(os.getpid()))
    assert re.fullmatch(r"/ringshm-\d+-\d+-[0-9a-f]{16}", segment.name)
    other = Segment.create(64)
    try:
        assert other.name != segment.name
    finally:
        other.close()
        other.unlink()


def test_attach_maps_the_same_memory_with_or_without_the_leading_slash(segment):
    segment.buf[:5] = b"hello"
    for name in (segment.name, segment.name.lstrip("/")):
        other = Segment.attach(name)
        try:
            assert other.size_bytes == 4096
            assert other.buf[:5] == b"hello"
            other.buf[5:6] = b"!"
            assert segment.buf[:6] == b"hello!"
            assert other.owner is False
        finally:
            other.close()


def test_attach_to_a_missing_name_raises_file_not_found():
    with pytest.raises(FileNotFoundError, match="ringshm-0-0"):
        Segment.attach("/ringshm-0-0-0123456789abcdef")


@pytest.mark.parametrize("size", [0, -1])
def test_create_with_a_size_below_one_byte_is_a_value_error(size):
    with pytest.raises(ValueError):
        Segment.create(size)


# ------------------------------------------------------------------------------------------ close / unlink
def test_unlink_by_the_creator_removes_the_name_is_idempotent_and_keeps_existing_mappings(segment):
    other = Segment.attach(segment.name)
    segment.unlink()
    segment.unlink()
    assert segment.name not in list_segments()
    with pytest.raises(FileNotFoundError):
        Segment.attach(segment.name)
    segment.buf[:2] = b"ok"
    assert other.buf[:2] == b"ok"  # both mappings still share the memory
    other.close()


def test_unlink_by_an_attacher_is_a_no_op(segment):
    other = Segment.attach(segment.name)
    other.unlink()
    other.close()
    assert segment.name in list_segments()


def test_close_is_idempotent_and_reports_a_mapping_kept_alive_by_a_view(segment):
    view = memoryview(segment.buf)
    assert segment.close() is False
    view.release()
    assert segment.close() is True
    assert segment.close() is True


# ---------------------------------------------------------------------------------------------- liveness
def test_this_process_is_alive_with_its_own_start_time_and_not_with_another():
    start = process_start_time(os.getpid())
    assert start is not None and start > 0
    assert is_alive(os.getpid())
    assert is_alive(os.getpid(), start)
    assert not is_alive(os.getpid(), start + 1)  # a reused pid is a different process


def test_a_reaped_child_and_non_positive_pids_are_not_alive(dead_pid):
    assert process_start_time(dead_pid) is None
    assert not is_alive(dead_pid)
    assert not is_alive(0)
    assert not is_alive(-1)


def test_a_zombie_child_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while True:  # wait for the exit without reaping it (no wait() or poll() on the Popen)
            state = open(f"/proc/{child.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0]
            if state == b"Z":
                break
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.002)
        assert process_start_time(child.pid) is None
        assert not is_alive(child.pid)
    finally:
        child.wait()


# ---------------------------------------------------------------------------------------------- sweep
def test_list_segments_lists_ringshm_names_only(segment):
    foreign = f"/notringshm-{os.getpid()}-{os.urandom(4).hex()}"
    _raw_segment(foreign)
    try:
        names = list_segments()
        assert segment.name in names
        assert foreign not in names
        assert all(creator_of(n) is not None for n in names)
        assert creator_of(foreign) is None
    finally:
        _unlink_quietly(foreign)


def test_sweep_stale_removes_segments_of_dead_or_reused_pids_and_keeps_live_and_foreign_ones(
    segment, dead_pid
):
    me, my_start = os.getpid(), process_start_time(os.getpid())
    dead = f"/ringshm-{dead_pid}-12345-{os.urandom(8).hex()}"
    reused = f"/ringshm-{me}-{my_start + 1}-{os.urandom(8).hex()}"  # our pid, another process's start time
    foreign = f"/otherapp-{dead_pid}-12345-{os.urandom(8).hex()}"
    for name in (dead, reused, foreign):
        _raw_segment(name)
    try:
        removed = sweep_stale()
        assert dead in removed and reused in removed
        assert segment.name not in removed and foreign not in removed
        present = set(list_segments())
        assert dead not in present and reused not in present
        assert segment.name in present
        assert os.path.exists(SHM_DIR / foreign.lstrip("/"))
        assert not {dead, reused, segment.name} & set(sweep_stale())  # a second sweep finds none of them
    finally:
        for name in (dead, reused, foreign):
            _unlink_quietly(name)
