"""Concurrency per GiB of KV (issue 22), figures only: how many 512-position streams run at once in the memory
that rows used to reserve.

Before KV lived in blocks, every stage reserved ``max_rows x max_seq_len`` positions of fp32 KV up front; with
``max_rows`` 4 at ``max_seq_len`` 2048 that is 8,192 positions (0.35 GiB for SmolLM2), and 4 streams ran at once
however short they were. Three engines get exactly that KV memory (``kv_cache_memory``) and the same 48
requests of 448 distinct prompt tokens + 64 generated (512 positions; no shared prefix, so the cache cannot help):

    rows      max_rows 4, fp32 KV: what that memory served before (4 rows x 2048)
    blocks    max_rows 64, fp32 KV in blocks of 32: as many 512-position streams as the blocks hold
    fp16      the same with fp16 KV (the default): twice the blocks in the same bytes

Per engine: the most streams running at once (``StepStats.peak_rows``), preemptions, output tok/s over the
whole batch, and each stage's peak RSS (``VmHWM``), all in one run. Ratios: peak streams of blocks / rows
(goal >= 4) and fp16 / blocks (goal >= 2).

    python -m pytest bench/bench_kv_memory.py --benchmark-only -s -p no:cacheprovider
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from conftest import cpu_info, cpu_label
from ringshm.engine.engine import Engine

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROWS_BEFORE, SEQ_BEFORE = 4, 2048
N_REQUESTS, PROMPT, NEW = 48, 448, 64
CONFIGS = {"rows": dict(max_rows=ROWS_BEFORE, kv_cache_dtype="float32"),
           "blocks": dict(max_rows=64, kv_cache_dtype="float32"),
           "fp16": dict(max_rows=64, kv_cache_dtype="float16")}
_RESULTS: dict[str, dict] = {}


def _kv_gib() -> float:
    """fp32 KV of ROWS_BEFORE x SEQ_BEFORE positions of the default model, in GiB."""
    from ringshm.model import packaged
    from ringshm.model.loader import read_config

    mc = read_config(str(packaged.default_model_path()))
    return ROWS_BEFORE * SEQ_BEFORE * mc.n_layers * 2 * mc.kv_dim * 4 / 2**30


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_streams_per_kv_memory(benchmark, figures, name):
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(N_REQUESTS)]
    gib = _kv_gib()
    with Engine(stages=3, max_seq_len=SEQ_BEFORE, kv_cache_memory=gib, progress=False, **CONFIGS[name]) as engine:
        engine.generate(prompts[0][:16], 2)  # warm-up
        out = []
        benchmark.pedantic(lambda: out.append(engine.generate_batch(prompts, NEW, ignore_eos=True)), rounds=1,
                           warmup_rounds=0)
        batch = out[0]
        rss = [_peak_rss_mib(pid) for pid in engine.pids]
        res = {"kv_cache_memory_gib": gib, "n_blocks": engine.n_blocks, "block_size": engine.config.block_size,
               "tokens_in_pool": engine.kv.tokens_capacity(), "peak_streams": batch.steps.peak_rows,
               "preemptions": batch.steps.preemptions, "output_tok_s": batch.output_tok_s,
               "stage_peak_rss_mib": rss, **CONFIGS[name]}
    _RESULTS[name] = res
    figures.record_value(f"kvmem.{name}.peak_streams_inv", 1 / res["peak_streams"])
    figures.record_value(f"kvmem.{name}.s_per_token", 1 / res["output_tok_s"])
    print(f"\n{name}: {res['n_blocks']} blocks ({res['tokens_in_pool']} positions) in {gib:.2f} GiB: "
          f"{res['peak_streams']} streams at once, {res['preemptions']} preemptions, {res['output_tok_s']:.1f} "
          f"output tok/s, stage peak RSS {', '.join(f'{r:.0f}' for r in rss)} MiB")
    if name == "fp16":
        figures.ratio("512-position streams at once, same KV memory: blocks / rows", "kvmem.rows.peak_streams_inv",
                      "kvmem.blocks.peak_streams_inv", ">= 4")
        figures.ratio("512-position streams at once, same KV memory: fp16 / fp32 blocks",
                      "kvmem.blocks.peak_streams_inv", "kvmem.fp16.peak_streams_inv", ">= 2")
        figures.ratio("output tok/s of the 48 requests: fp16 blocks / rows", "kvmem.rows.s_per_token",
                      "kvmem.fp16.s_per_token")


@pytest.fixture(scope="module", autouse=True)
def _report(figures):
    yield
    figures.summary.append(f"KV memory (bench_kv_memory.py), CPU: {cpu_label()}")
    for name, r in _RESULTS.items():
        figures.summary.append(
            f"{name:>7}: max_rows {r['max_rows']:>2}, {r['kv_cache_dtype']}, {r['n_blocks']} blocks: "
            f"{r['peak_streams']:>2} streams at once, {r['preemptions']} preemptions, {r['output_tok_s']:.1f} tok/s, "
            f"stage peak RSS {', '.join(f'{x:.0f}' for x in r['stage_peak_rss_mib'])} MiB")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"kv-memory-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"cpu": cpu_info(), "results": _RESULTS}, indent=2))
