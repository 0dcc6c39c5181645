"""A stage's intra-op threads (``ThreadPicker``, issue 19): the shared cores split among the stages computing now,
and one thread while other processes hold the cores, with a probe that gives the split back when they free up.

The clock and the involuntary-switch counter are injected: each fake op advances the clock and adds switches
(its process lost a core mid-op) at a given rate per second, rounded at random from a seeded generator.
Measured on 2 cores: 25-49 /s on a quiet machine, 183-1135 /s beside one or two CPU-bound processes.
"""

from __future__ import annotations

import random

import pytest
import torch

from ringshm.runtime.stage import N_SLOTS, SLOT_ACTIVE, StageSpec
from ringshm.runtime.stage_threads import ThreadPicker


def spec(index=0, n_stages=2, cores=2, device="cpu") -> StageSpec:
    return StageSpec(index=index, n_stages=n_stages, model_path="", layer_start=0, layer_stop=1, max_rows=1,
                     max_seq_len=8, dtype="float32", device=device, in_ring="", out_ring="", cores=cores,
                     ring_timeout_s=1.0, max_op_tokens=8)


class Clocks:
    def __init__(self):
        self.wall, self.switches, self.rng = 0.0, 0, random.Random(0)

    def run(self, picker: ThreadPicker, wall_s: float, per_s: float) -> int:
        """One op: ``before_op`` picks the threads, the op takes ``wall_s`` with ``per_s`` involuntary switches
        a second on average; returns the threads it ran on."""
        threads = picker.before_op()
        self.wall += wall_s
        self.switches += int(per_s * wall_s + self.rng.random())
        picker.after_op()
        return threads


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The picker sets torch's threads in this process: each test gives them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def make(status=None, **kw):
    clocks = Clocks()
    status = status if status is not None else [0.0] * (N_SLOTS * kw.get("n_stages", 2))
    return ThreadPicker(spec(**kw), status, clock=lambda: clocks.wall, switches=lambda: clocks.switches), clocks


def test_split_counts_the_stages_computing_now():
    status = [0.0] * (N_SLOTS * 3)
    picker, _ = make(status, n_stages=3, cores=4)
    assert picker.before_op() == 4  # alone: every core
    status[1 * N_SLOTS + SLOT_ACTIVE] = 1.0
    assert picker.before_op() == 2 and torch.get_num_threads() == 2
    status[2 * N_SLOTS + SLOT_ACTIVE] = 1.0
    assert picker.before_op() == 1  # 4 // 3


def test_a_quiet_machine_keeps_the_split():
    picker, clocks = make()
    assert all(clocks.run(picker, 2e-3, 50) == 2 for _ in range(5000))
    assert picker.contended_since is None


def test_contended_cores_drop_to_one_thread_and_a_probe_gives_them_back():
    picker, clocks = make()
    ran = [clocks.run(picker, 2e-3, 600) for _ in range(30)]
    first_one = ran.index(1)
    assert first_one <= 20 and all(t == 2 for t in ran[:first_one])  # a few ops pull the average up
    # Still contended: the split only on probes, ever rarer (waits doubling up to PROBE_MAX_S), the other
    # ops on one thread.
    ran = [clocks.run(picker, 2e-3, 600) for _ in range(int(10 * ThreadPicker.PROBE_MAX_S / 2e-3))]
    assert ran.count(1) > 0.99 * len(ran) and 10 <= ran.count(2) <= 16
    # The neighbour leaves: the next probe gives the split back for good.
    ran = [clocks.run(picker, 2e-3, 30) for _ in range(int(3 * ThreadPicker.PROBE_MAX_S / 2e-3))]
    assert picker.contended_since is None
    assert ran[-200:] == [2] * 200


def test_short_ops_and_one_thread_ops_are_not_measured():
    picker, clocks = make()
    for _ in range(50):  # shorter than MIN_WALL_S: not measured
        clocks.run(picker, ThreadPicker.MIN_WALL_S / 2, 5000)
    assert picker.contended_since is None and picker.switch_rate == 0.0
    status = [0.0] * (N_SLOTS * 2)
    status[1 * N_SLOTS + SLOT_ACTIVE] = 1.0  # the other stage computes: this one gets 1 of 2 cores
    picker, clocks = make(status)
    for _ in range(50):
        assert clocks.run(picker, 2e-3, 5000) == 1
    assert picker.contended_since is None


def test_one_core_leaves_torch_alone():
    picker, clocks = make(cores=1)
    before = torch.get_num_threads()
    clocks.run(picker, 2e-3, 5000)
    assert torch.get_num_threads() == before and picker.current == 0


def test_a_gpu_stage_is_never_called_contended():
    """Its ops wait on the device, not on the cores."""
    picker, clocks = make(device="cuda")
    assert all(clocks.run(picker, 2e-3, 5000) == 2 for _ in range(50))
    assert picker.contended_since is None
