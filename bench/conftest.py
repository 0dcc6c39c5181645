"""Benchmark session plumbing: benches register (name, median seconds, extra) figures; at the end of the
session every ratio a bench asked for is printed and saved as JSON under bench/results/, followed by the
summary lines a bench's plot added (its own table).

Options: ``--peer-url URL``, an already running OpenAI-compatible server that bench_server.py loads too
(e.g. vLLM at http://127.0.0.1:8200/v1; see that module's docstring).

Figures only: nothing here asserts on time (these machines are shared and noisy; quote medians and ratios).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class Figures:
    """Medians and ratios measured in one benchmark session."""

    def __init__(self) -> None:
        self.medians: dict[str, float] = {}
        self.extra: dict[str, dict] = {}
        self.ratios: list[tuple[str, str, str, str]] = []  # (label, numerator, denominator, goal)
        self.paired: list[dict] = []  # ratios measured round by round (paired_ratio)
        self.plots: list = []  # callables (figures, results_dir, stamp) -> path of a PNG, run at the end
        self.summary: list[str] = []  # lines printed after the ratios (a plot may add its bench's table)

    def record(self, name: str, benchmark, per: int = 1, **extra) -> None:
        """Store the benchmark's median (seconds) divided by ``per`` operations per round."""
        self.medians[name] = benchmark.stats.stats.median / per
        self.extra[name] = extra
        benchmark.extra_info.update(extra, per_op_median_s=self.medians[name])

    def record_value(self, name: str, seconds: float, **extra) -> None:
        """Store a median the bench computed itself (e.g. the median TPOT over rounds), in seconds."""
        self.medians[name] = seconds
        self.extra[name] = extra

    def ratio(self, label: str, numerator: str, denominator: str, goal: str = "") -> None:
        """Ask for ``median(numerator) / median(denominator)`` in the end-of-session table."""
        self.ratios.append((label, numerator, denominator, goal))

    def paired_ratio(self, label: str, pairs: list[tuple[float, float]], goal: str = "") -> None:
        """A ratio measured round by round: ``pairs`` holds each round's (numerator, denominator) seconds, timed
        back to back (A B B A, the order flipped every round), and the figure is the median over rounds of
        numerator / denominator. The VM's speed drifts by +-15 % within minutes: a ratio of two medians lets the
        drift between the rounds in, a round's own ratio sees only what changed within it."""
        ratios = sorted(n / d for n, d in pairs)
        self.paired.append({"ratio": label, "numerator_s": statistics.median(n for n, _ in pairs),
                            "denominator_s": statistics.median(d for _, d in pairs),
                            "value": statistics.median(ratios), "rounds": len(pairs),
                            "range": [ratios[0], ratios[-1]], "goal": goal})

    def table(self) -> list[dict]:
        rows = list(self.paired)
        for label, num, den, goal in self.ratios:
            if num in self.medians and den in self.medians:
                rows.append(
                    {
                        "ratio": label,
                        "numerator_s": self.medians[num],
                        "denominator_s": self.medians[den],
                        "value": self.medians[num] / self.medians[den],
                        "goal": goal,
                    }
                )
        return rows


def cpu_info() -> dict:
    """The CPU's model name, vendor, family / model, which of the SIMD levels that matter here it flags (from
    /proc/cpuinfo), and the ISA path ringshm's kernels run on it."""
    first: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            first.setdefault(key, value)
    except OSError:
        pass
    flags = set((first.get("flags") or first.get("Features") or "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni") if f in flags]
    if any(f.startswith("amx") for f in flags):
        simd.append("amx")
    try:
        from ringshm.model.qmatmul import BEST_ISA, F16, ISA_NAMES, Q4_K, row_prefetch_for

        quant, floats = ([m for m in range(1, 65) if row_prefetch_for(t, m)] for t in (Q4_K, F16))
        prefetch = ("on" if quant[:1] == floats[:1] == [1] else "off" if not quant + floats
                    else f"from {quant[0] if quant else '-'} rows ({floats[0] if floats else '-'} of a float weight)")
        isa = f"{ISA_NAMES[BEST_ISA]}, row prefetch {prefetch}"
    except (ImportError, AttributeError):  # the C extension is not built, or is older than this file
        isa = "?"
    return {"model_name": first.get("model name") or platform.processor() or platform.machine(), "simd": simd,
            "cores": len(os.sched_getaffinity(0)), "machine": platform.machine(),
            "vendor": first.get("vendor_id", "?"), "family": first.get("cpu family", "?"),
            "model": first.get("model", "?"), "isa": isa}


def cpu_label(cpu: dict | None = None) -> str:
    """One line naming the CPU for a table: model name, vendor family / model, cores, SIMD flags, ISA path and whether
    the matmuls prefetch the rows ahead (``qmatmul.row_prefetch_for``: from how many rows of an fp32 op)."""
    cpu = cpu or cpu_info()
    return (f"{cpu['model_name']} ({cpu['vendor']} family {cpu['family']} model {cpu['model']}, {cpu['machine']}, "
            f"{cpu['cores']} cores; SIMD: {', '.join(cpu['simd']) or 'none of avx2/avx512f/amx'}; "
            f"ringshm path: {cpu['isa']})")


_PEAKS: dict[int, float] = {}


def fma_peak(threads: int) -> float:
    """The fp32 FMA peak, flop/s, of the ISA path ringshm runs on with ``threads`` threads: ``qmatmul.fma_probe``
    (independent 16-lane fma chains on every thread, csrc/matmul.h) sized to ~0.05 s or more, the best of 5 rounds
    (what the machine can do: a shared machine's slow moments only lower it); measured once per process. The
    compute roof of the fp32 contract's matmuls (``bench_roofline.py``, ``bench_sizes.py``)."""
    if threads not in _PEAKS:
        from ringshm.model import qmatmul as qm

        iters = 1 << 16
        while True:
            t0 = time.perf_counter()
            qm.fma_probe(iters, threads)
            if time.perf_counter() - t0 > 0.05:
                break
            iters *= 4
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            flops = qm.fma_probe(iters, threads)
            best = min(best, time.perf_counter() - t0)
        _PEAKS[threads] = flops / best
    return _PEAKS[threads]


@contextmanager
def ringshm_server(*args: str, startup_s: float = 180.0):
    """``ringshm serve`` in a subprocess on a free loopback port with ``args``; yields its base URL
    (``http://127.0.0.1:PORT``) once ``/health`` answers 200, SIGTERMs it on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "ringshm.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


_FIGURES = Figures()


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0..1) of ``xs``; NaN when empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def run_together(calls: list) -> float:
    """Run every callable in ``calls`` on its own thread, all started before any is joined; returns the wall
    seconds from the first start to the last join."""
    import threading

    threads = [threading.Thread(target=c) for c in calls]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pytest_addoption(parser):
    parser.addoption("--peer-url", default=None, metavar="URL",
                     help="base URL of a running OpenAI-compatible server (e.g. http://127.0.0.1:8200/v1) that "
                          "bench_server.py loads too, before ringshm's, at the same client levels")


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_sessionfinish(session, exitstatus):
    rows = _FIGURES.table()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if not _FIGURES.medians:
        if reporter is not None and _FIGURES.summary:  # a bench that only reports lines (e.g. latency p99)
            reporter.write_sep("=", "figures from this run")
            for line in _FIGURES.summary:
                reporter.write_line(line)
        return
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS_DIR / f"ratios-{stamp}.json"
    out.write_text(json.dumps({"medians_s": _FIGURES.medians, "extra": _FIGURES.extra, "ratios": rows}, indent=2))
    plots = [plot(_FIGURES, RESULTS_DIR, stamp) for plot in _FIGURES.plots]
    if reporter is not None:
        reporter.write_sep("=", "ratios (medians from this run)")
        for r in rows:
            goal = f"  goal {r['goal']}" if r["goal"] else ""
            paired = (f"  (median of {r['rounds']} paired rounds, {r['range'][0]:.3f}-{r['range'][1]:.3f})"
                      if "rounds" in r else "")
            reporter.write_line(f"{r['ratio']:<58} {r['value']:8.3f}{goal}{paired}")
        for line in _FIGURES.summary:
            reporter.write_line(line)
        reporter.write_line(f"saved {out}")
        for path in plots:
            reporter.write_line(f"saved {path}")
