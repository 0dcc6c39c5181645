"""8-bit activations (``matmul_activations="int8"``, issue 28's opt-in) against the fp32 contract, figures only.

On the default model (SmolLM2-135M, Q4_1 + Q8_0), one stage, the two engines side by side, interleaved over
``ROUNDS`` rounds (medians; this VM drifts by ±15 % within minutes):
- aggregate decode of 1, 8 and 16 streams arriving together (16-token prompts, ``N_NEW`` tokens each, EOS
  ignored): the sum of each stream's 1 / TPOT (decode only, prefill excluded), and its ratio to one stream
  (issue 28's goal: 16 streams >= 4 x one stream, 8 >= 3 x);
- how far greedy int8 follows fp32: over the ``CHATS`` prompts (chat template), the tokens equal before
  the first that differs (the 8-bit contract is not the oracle's; fp32's greedy equals transformers').

    python -m pytest bench/bench_int8.py --benchmark-only -s -p no:cacheprovider
"""

from __future__ import annotations

import statistics

import numpy as np

from conftest import cpu_label
from ringshm.engine.engine import Engine

ROUNDS = 3
N_NEW, N_PROMPT = 128, 16
STREAMS = (1, 8, 16)
N_AGREE = 64
CHATS = ["What is the capital of France?", "Write a haiku about shared memory.",
         "List three prime numbers and explain why each one is prime.", "Explain what a ring buffer is.",
         "Give me a recipe for pancakes.", "Why is the sky blue?", "Write a Python function that reverses a string.",
         "What are the benefits of regular exercise?"]


def test_int8_activations_vs_fp32(benchmark, figures):
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(100, 40000, N_PROMPT)] for _ in range(max(STREAMS))]
    rates: dict[str, dict[int, list[float]]] = {a: {n: [] for n in STREAMS} for a in ("float32", "int8")}
    agree: list[tuple[int, int]] = []
    engines = {a: Engine(stages=1, max_rows=max(STREAMS), max_seq_len=512, progress=False, prefix_cache=False,
                         matmul_activations=a) for a in ("float32", "int8")}
    try:
        for eng in engines.values():
            eng.generate_batch(prompts, max_new_tokens=4, stop=None, ignore_eos=True)  # warm

        def run():
            for _ in range(ROUNDS):
                for n in STREAMS:
                    for act, eng in engines.items():
                        out = eng.generate_batch(prompts[:n], max_new_tokens=N_NEW, stop=None, ignore_eos=True)
                        rates[act][n].append(sum(1 / r.tpot_s for r in out.results))
            for text in CHATS:
                a, b = (engines[x].generate(text, max_new_tokens=N_AGREE, chat=True).token_ids
                        for x in ("float32", "int8"))
                same = next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
                agree.append((same, min(len(a), len(b))))

        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        for eng in engines.values():
            eng.close()
    med = {a: {n: statistics.median(v) for n, v in r.items()} for a, r in rates.items()}
    lines = [f"8-bit activations vs fp32 (bench_int8.py), default model, 1 stage, CPU: {cpu_label()}",
             f"{'streams':>7} | {'fp32 tok/s':>10} {'/ 1':>5} | {'int8 tok/s':>10} {'/ 1':>5} {'/ fp32':>6}"]
    for n in STREAMS:
        f, q = med["float32"][n], med["int8"][n]
        lines.append(f"{n:>7} | {f:10.1f} {f / med['float32'][1]:5.2f} | {q:10.1f} {q / med['int8'][1]:5.2f} "
                     f"{q / f:6.2f}")
        figures.record_value(f"int8.agg.{n}.float32", 1 / f)
        figures.record_value(f"int8.agg.{n}.int8", 1 / q)
        if n > 1:
            figures.ratio(f"int8: aggregate decode {n} streams / 1 stream", "int8.agg.1.int8", f"int8.agg.{n}.int8",
                          ">= 4" if n == 16 else ">= 3")
    lines.append("greedy int8 equal to fp32 for the first " + ", ".join(f"{s} of {t}" for s, t in agree)
                 + f" tokens ({len(CHATS)} chat prompts)")
    figures.summary.extend(lines)
    assert all(v for r in rates.values() for v in r.values())
