"""A stage's intra-op threads (``ThreadPicker``, issue 19): the shared cores split among the stages computing now,
and one thread while other processes hold the cores, with a probe that gives the split back when they free up.

The clocks are injected: ``wall`` and ``cpu`` advance by what each fake op says, so a contended op is one whose
threads got less CPU time than wall time x threads (efficiency 0.4 here; 0.86 measured quiet, 0.50 beside one
CPU-bound neighbour on 2 cores).
"""

from __future__ import annotations

import torch

from ringshm.runtime.stage import N_SLOTS, SLOT_ACTIVE, StageSpec, ThreadPicker


def spec(index=0, n_stages=2, cores=2, device="cpu") -> StageSpec:
    return StageSpec(index=index, n_stages=n_stages, model_path="", layer_start=0, layer_stop=1, max_rows=1,
                     max_seq_len=8, dtype="float32", device=device, in_ring="", out_ring="", cores=cores,
                     ring_timeout_s=1.0)


class Clocks:
    def __init__(self):
        self.wall = self.cpu = 0.0

    def run(self, picker: ThreadPicker, wall_s: float, efficiency: float) -> int:
        """One op: ``before_op`` picks the threads, the op takes ``wall_s`` and that many threads got
        ``efficiency`` of their cores; returns the threads it ran on."""
        threads = picker.before_op()
        self.wall += wall_s
        self.cpu += wall_s * threads * efficiency
        picker.after_op()
        return threads


def make(status=None, **kw):
    clocks = Clocks()
    status = status if status is not None else [0.0] * (N_SLOTS * kw.get("n_stages", 2))
    return ThreadPicker(spec(**kw), status, clock=lambda: clocks.wall, cpu_clock=lambda: clocks.cpu), clocks


def test_split_counts_the_stages_computing_now(monkeypatch):
    status = [0.0] * (N_SLOTS * 3)
    picker, _ = make(status, n_stages=3, cores=4)
    before = torch.get_num_threads()
    try:
        assert picker.before_op() == 4  # alone: every core
        status[1 * N_SLOTS + SLOT_ACTIVE] = 1.0
        assert picker.before_op() == 2 and torch.get_num_threads() == 2
        status[2 * N_SLOTS + SLOT_ACTIVE] = 1.0
        assert picker.before_op() == 1  # 4 // 3
    finally:
        torch.set_num_threads(before)


def test_a_quiet_machine_keeps_the_split():
    picker, clocks = make()
    before = torch.get_num_threads()
    try:
        assert all(clocks.run(picker, 2e-3, 0.86) == 2 for _ in range(200))
        assert picker.contended_since is None
    finally:
        torch.set_num_threads(before)


def test_contended_cores_drop_to_one_thread_and_a_probe_gives_them_back():
    picker, clocks = make()
    before = torch.get_num_threads()
    try:
        ran = [clocks.run(picker, 2e-3, 0.4) for _ in range(20)]
        first_one = ran.index(1)
        assert first_one <= 4 and all(t == 2 for t in ran[:first_one])  # a few ops pull the average down
        assert picker.contended_since is not None
        # Still contended: one op on the split every PROBE_S, the rest on one thread.
        ran = [clocks.run(picker, 2e-3, 0.4) for _ in range(int(2 * ThreadPicker.PROBE_S / 2e-3))]
        assert 1 <= ran.count(2) <= 3 and ran.count(1) >= len(ran) - 3
        assert picker.contended_since is not None
        # The neighbour leaves: the next probe sees a clean op and the split is back for good.
        ran = [clocks.run(picker, 2e-3, 0.9) for _ in range(int(2 * ThreadPicker.PROBE_S / 2e-3))]
        assert picker.contended_since is None
        assert ran[-50:] == [2] * 50
    finally:
        torch.set_num_threads(before)


def test_short_ops_and_one_thread_ops_are_not_measured():
    picker, clocks = make()
    before = torch.get_num_threads()
    try:
        for _ in range(50):  # too short to tell contention from fork/join cost
            clocks.run(picker, ThreadPicker.MIN_WALL_S / 2, 0.1)
        assert picker.contended_since is None and picker.efficiency == 1.0
        status = [0.0] * (N_SLOTS * 2)
        status[1 * N_SLOTS + SLOT_ACTIVE] = 1.0  # the other stage computes: this one gets 1 of 2 cores
        picker, clocks = make(status)
        for _ in range(50):
            assert clocks.run(picker, 2e-3, 0.1) == 1
        assert picker.contended_since is None
    finally:
        torch.set_num_threads(before)


def test_one_core_leaves_torch_alone():
    picker, clocks = make(cores=1)
    before = torch.get_num_threads()
    clocks.run(picker, 2e-3, 0.1)
    assert torch.get_num_threads() == before and picker.current == 0


def test_a_gpu_stage_is_never_called_contended():
    """Its ops wait on the device: little CPU time is no sign of a busy machine."""
    picker, clocks = make(device="cuda")
    before = torch.get_num_threads()
    try:
        assert all(clocks.run(picker, 2e-3, 0.1) == 2 for _ in range(50))
        assert picker.contended_since is None
    finally:
        torch.set_num_threads(before)
