"""A stage's intra-op torch threads per op (``ThreadPicker``): the shared cores split among the stages computing now,
and one thread while other processes take the machine's cores. The stage loop (``ringshm.runtime.stage``) asks it
before and after each op."""

from __future__ import annotations

import os
import resource
import time
from typing import TYPE_CHECKING

from ringshm.runtime.stage_status import N_SLOTS, SLOT_ACTIVE

if TYPE_CHECKING:
    from ringshm.runtime.stage import StageSpec


PIN_NONE, PIN_WORKERS, PIN_ALL = 0, 1, 2  # ThreadPicker.pinned: no thread pinned; the pool's workers only; all


class ThreadPicker:
    """Intra-op torch threads for each op: the shared cores split among the stages computing now, and one thread
    while the machine's cores are taken by other processes.

    - Split: a single stream's decode visits the stages one after another, so the stage at work may use every
      core; a pipelined prefill keeps several stages busy at once, and more threads than cores would
      oversubscribe them. Measured on 2 cores: 3 stages with 1 thread each decoded at 0.63 x a 1-stage engine
      with 2.
    - Contention: an op's threads meet at barriers, so one thread that lost its core to another process holds
      the op back for a scheduler time slice. Measured on 2 cores with one CPU-bound neighbour, a 10-layer
      decode op took 15.3 ms with 2 threads and 2.65 ms with 1 (2.06 ms with 2 on a quiet machine). The sign of
      it is the kernel taking cores away mid-op: involuntary context switches of the process (``getrusage``'s
      ``ru_nivcsw``, all threads) per second of op. Measured over decode ops of 1.4-36 ms (SmolLM2 at 1 and 3
      stages, a Llama-3.2-1B shape at 1): 25-49 /s on average on a quiet machine, 183-1135 /s per stage beside
      one or two CPU-bound processes. (CPU time over wall x threads cannot tell: a 10-layer SmolLM2 decode op
      runs most of its work on one thread, 0.50 quiet; a count per op cannot either: a long op sees a few
      switches on a quiet machine.) So after every op of at least ``MIN_WALL_S`` on 2+ threads its rate feeds
      a moving average; over ``CONTENDED`` the stage runs its ops on one thread and now and then one op on the
      split again (a probe: after ``PROBE_MIN_S``, then twice as long after each that fails, up to
      ``PROBE_MAX_S``, so a neighbour that was busy for a moment costs little and a lasting one few probes):
      one op under ``CONTENDED`` ends the contended state. The thread count never
      changes a bit of the result (batch invariance: every output element is reduced in one fixed order
      whatever the threads).
    - Placement: an op of at most ``PIN_MAX_TOKENS`` tokens (decode, verify, a short chunk) that takes every CPU
      the stage may use runs with its threads pinned one to a CPU (the caller keeps its own;
      ``ringshm_pin_threads``, csrc/kernels.h), and they stay pinned while such ops follow. A stage sleeps on its
      ring between ops, and its pool workers sleep with it; woken, a worker often landed on the caller's CPU,
      where the caller, spinning at the end of each region for it, kept it off until its spin gave up: every
      region after the sleep took 170-290 us instead of 0.6 us until the kernel moved one of them. Measured on
      2 cores (AMD EPYC Zen 5, SmolLM2): a 3-stage engine decoded one stream at 0.52-0.85 x a 1-stage one
      unpinned, 0.80-0.92 x pinned; 16 streams on 3 stages 1.08-1.16 x the tok/s. Longer ops (prefill chunks) run
      free: their regions are long, the kernel has time to spread the threads, and a pinned op that overlaps
      another stage's (two stages that started at once both took every core) cannot move off its CPUs: with
      every op pinned a 3-stage 433-token TTFT took 1.08 x as long, with this limit 0.99 x. When the op is
      long, or the cores are split or contended, the caller is freed at once and the workers, asleep, only
      before they run again. Only a stage of exactly ``PIN_CPUS`` CPUs pins: a region of fewer threads than the
      pool has (but more than one) makes libgomp end the spare workers, and the ones it starts later inherit the
      pinned caller's CPU; on 2 CPUs a smaller region is one thread, which leaves the pool as it is.

    ``cores <= 1`` leaves torch alone (e.g. a fake stage running in a test's thread). A GPU stage only splits:
    its ops wait on the device, so the cores are not what they wait for.
    """

    CONTENDED = 150.0  # involuntary switches per second of op above which the cores are taken by others
    MIN_WALL_S = 5e-4  # ops shorter than this are not measured
    PROBE_MIN_S, PROBE_MAX_S = 0.05, 1.0  # a contended stage's waits before it tries the split again
    SMOOTHING = 0.05  # weight of the newest op in the moving average
    PIN_MAX_TOKENS = 64  # ops of at most this many tokens are pinned when they take every CPU (Placement)
    PIN_CPUS = 2  # only a stage of exactly this many CPUs pins (Placement)

    def __init__(self, spec: StageSpec, status, clock=time.perf_counter, switches=None, pin=None):
        self.spec, self.status, self.clock = spec, status, clock
        self.switches = switches or _involuntary_switches
        self.pin = pin or pin_threads
        self.cpus = sorted(os.sched_getaffinity(0))  # the CPUs this stage may run on (the fork server's)
        self.pinned = PIN_NONE
        self.current = 0  # threads torch runs with now (0: not set yet)
        self.switch_rate = 0.0  # moving average of involuntary switches per second of op
        self.contended_since: float | None = None
        self._probe_at, self._probe_wait = 0.0, self.PROBE_MIN_S
        self._t0, self._s0 = 0.0, 0

    def split(self) -> int:
        """The cores over the stages computing now (this one included)."""
        spec = self.spec
        others = sum(self.status[i * N_SLOTS + SLOT_ACTIVE] > 0 for i in range(spec.n_stages) if i != spec.index)
        return max(1, spec.cores // (others + 1))

    def _measured(self) -> bool:
        return self.spec.cores > 1 and self.spec.device == "cpu" and self.current >= 2

    def before_op(self, n_tokens: int = 1) -> int:
        """Set torch's threads (and placement) for the next op, of ``n_tokens`` tokens; returns the threads."""
        if self.spec.cores <= 1:
            return self.current
        want = self.split()
        now = self.clock()
        if self.contended_since is not None and want > 1:
            if now >= self._probe_at:  # this op runs on the split: after_op decides
                self._probe_wait = min(2 * self._probe_wait, self.PROBE_MAX_S)
                self._probe_at = now + self._probe_wait
            else:
                want = 1
        if want != self.current:
            import torch

            torch.set_num_threads(want)
            self.current = want
        self._place(want, n_tokens)
        if self._measured():
            self._t0, self._s0 = now, self.switches()
        return want

    def _place(self, want: int, n_tokens: int) -> None:
        """Pin a short op's threads when it takes every CPU, else free them (see Placement)."""
        if want == len(self.cpus) == self.PIN_CPUS and self.spec.device == "cpu" and n_tokens <= self.PIN_MAX_TOKENS:
            target = PIN_ALL
        elif self.pinned == PIN_NONE or (self.pinned == PIN_WORKERS and want < 2):
            return
        else:  # the caller at once; the pool's workers too when the op will wake them
            target = PIN_WORKERS if want < 2 else PIN_NONE
        if target != self.pinned:
            if self.pin(self.cpus, target):  # placement only speeds up: a CPU set that refuses it ends it
                cpus, self.cpus = self.cpus, []
                self.pin(cpus, PIN_NONE)
                target = PIN_NONE
            self.pinned = target

    def after_op(self) -> None:
        """Measure the op just run (``before_op`` started the counters) and update the contention state."""
        wall = self.clock() - self._t0
        if not self._measured() or wall < self.MIN_WALL_S:
            return
        rate = (self.switches() - self._s0) / wall
        if self.contended_since is not None:  # a probe: one op that kept its cores ends the contended state
            if rate < self.CONTENDED:
                self.contended_since, self.switch_rate = None, 0.0
            return
        self.switch_rate += self.SMOOTHING * (rate - self.switch_rate)
        if self.switch_rate > self.CONTENDED:
            self.contended_since, self._probe_wait = self.clock(), self.PROBE_MIN_S
            self._probe_at = self.contended_since + self._probe_wait


def _involuntary_switches() -> int:
    """Times the kernel took a core from any thread of this process so far (``getrusage`` ``ru_nivcsw``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def pin_threads(cpus: list[int], target: int) -> int:
    """Place the calling thread and the kernels' OpenMP pool workers on ``cpus``: ``PIN_ALL`` one to a CPU (the
    caller keeps its own; csrc/kernels.h, ``ringshm_pin_threads``), ``PIN_WORKERS`` the caller free to run on any
    of them (the workers keep theirs; one ``sched_setaffinity``, no region), ``PIN_NONE`` every thread free.
    Returns 0, or non-zero where the threads could not all be placed (an errno of ``sched_setaffinity``, EAGAIN
    for a short team, 1 for anything else raised): placement only speeds up, so a failure never fails an op."""
    try:
        if target == PIN_WORKERS:
            os.sched_setaffinity(0, cpus)
            return 0
        from ringshm._C import ffi, lib

        return int(lib.ringshm_pin_threads(ffi.new("int[]", cpus), len(cpus), int(target == PIN_ALL)))
    except Exception as exc:  # noqa: BLE001 - see Returns
        return getattr(exc, "errno", None) or 1
