"""Engine benchmarks (issue 4): decode tok/s and TTFT of the ring engine with 3 stages vs 1 stage vs the
model in-process (no ring at all) vs transformers, same prompt, same run; and the per-hop ring overhead per
decode op measured inside the engine. Figures only.

Goals: 3 stages >= 0.9 x 1 stage on decode tok/s; >= 2 x transformers.
Run: ``python -m pytest bench/bench_engine.py --benchmark-only``.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from ringshm.engine.engine import Engine
from ringshm.model.packaged import default_model_path
from ringshm.model.stage_model import StageModel

PROMPT = "Explain in a few sentences how a ring buffer lets two processes exchange messages."
N_NEW = 48
ROUNDS = 3
KW = dict(prefill_chunk=256, max_rows=1, max_seq_len=512, progress=False,
          prefix_cache=False)  # prefix_cache off: every round prefills cold (a repeated prompt would hit)


@pytest.fixture(scope="module")
def prompt_ids():
    with Engine(stages=1, **KW) as eng:
        return eng.encode(PROMPT, chat=True)


def _engine_bench(benchmark, figures, stages: int, prompt_ids, hop_key: str | None = None):
    results = []
    with Engine(stages=stages, **KW) as eng:
        eng.generate(prompt_ids, max_new_tokens=4)  # warm up
        def run():
            results.append(eng.generate(prompt_ids, max_new_tokens=N_NEW, stop=None))
        benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=0)
    tpot = statistics.median(r.tpot_s for r in results)
    ttft = statistics.median(r.ttft_s for r in results)
    hop = statistics.median(r.hop_overhead_us for r in results)
    coord = statistics.median(r.coordinator_us_per_op for r in results)
    figures.record_value(f"decode_tpot.engine_{stages}stages", tpot, tok_s=1 / tpot, hop_overhead_us=hop,
                         coordinator_us_per_op=coord)
    figures.record_value(f"ttft.engine_{stages}stages", ttft)
    benchmark.extra_info.update(decode_tok_s=1 / tpot, ttft_s=ttft, hop_overhead_us=hop, coordinator_us_per_op=coord,
                                n_output_tokens=results[-1].n_output_tokens)
    print(f"\n{stages} stages: decode {1 / tpot:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms, "
          f"ring {hop:.0f} us per hop and coordinator {coord:.0f} us per decode op")


def test_engine_3_stages(benchmark, figures, prompt_ids):
    _engine_bench(benchmark, figures, 3, prompt_ids)
    figures.ratio("decode tok/s: 3 stages / 1 stage", "decode_tpot.engine_1stages", "decode_tpot.engine_3stages",
                  ">= 0.9")
    figures.ratio("decode tok/s: 3 stages / transformers", "decode_tpot.transformers",
                  "decode_tpot.engine_3stages", ">= 2")
    figures.ratio("decode tok/s: 3 stages / in-process StageModel", "decode_tpot.in_process",
                  "decode_tpot.engine_3stages")
    figures.ratio("TTFT: 3 stages / 1 stage", "ttft.engine_3stages", "ttft.engine_1stages")


def test_engine_1_stage(benchmark, figures, prompt_ids):
    _engine_bench(benchmark, figures, 1, prompt_ids)


def test_in_process_stage_model(benchmark, figures, prompt_ids):
    """The whole model as one StageModel in this process: the engine's compute without any ring."""
    model = StageModel.from_path(default_model_path(), max_rows=1, max_seq_len=512)
    tpots = []

    def run():
        out = model.forward(torch.tensor(prompt_ids), 0, 0)
        token, pos = int(out.token_ids[-1]), len(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(N_NEW - 1):
            token = int(model.forward(torch.tensor([token]), 0, pos).token_ids[-1])
            pos += 1
        tpots.append((time.perf_counter() - t0) / (N_NEW - 1))

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    figures.record_value("decode_tpot.in_process", statistics.median(tpots))


def test_transformers(benchmark, figures, prompt_ids):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    tpots, ttfts = [], []

    @torch.inference_mode()
    def run():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        token = out.logits[0, -1].argmax().view(1, 1)
        t1 = time.perf_counter()
        for _ in range(N_NEW - 1):
            out = model(token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[0, -1].argmax().view(1, 1)
        tpots.append((time.perf_counter() - t1) / (N_NEW - 1))
        ttfts.append(t1 - t0)

    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
    figures.record_value("decode_tpot.transformers", statistics.median(tpots), threads=torch.get_num_threads())
    figures.record_value("ttft.transformers", statistics.median(ttfts))
