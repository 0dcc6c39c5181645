"""Many streams on the real model over 3 stage processes: B = 4 multi-chunk prompts of different lengths
through the one scheduler, prefill_depth 1 vs 8 and decode depth 1 vs 3. Every stream equals solo byte for
byte (the CPU kernels are batch-invariant), and solo equals the oracle tie-aware. The seeded random schedules
are tests/test_engine_step.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from engine_prompts import LONG_TEXT, LONG_TOPICS
from ringshm.engine.engine import Engine
from ringshm.errors import StageDied
from ringshm.transport.segment import list_segments, process_start_time

N_NEW = 10
CHUNK = 32


def batch_prompts() -> list[str]:
    """Four user turns of different lengths: 2 to 6 chunks of 32 tokens with the chat template."""
    return [LONG_TEXT[: 60 + 90 * i] + " " + " ".join(LONG_TOPICS[: 2 * i + 1]) + ". Summarise." for i in range(4)]


@pytest.fixture(scope="module")
def engine(model_path):
    with Engine(model_path, stages=3, prefill_chunk=CHUNK, max_rows=4, max_seq_len=512, progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[list[int]]:
    ids = [engine.encode(p, chat=True) for p in batch_prompts()]
    chunks = sorted(-(-len(p) // CHUNK) for p in ids)
    assert chunks[0] >= 2 and chunks[-1] > chunks[0], f"prompts must span several, different chunk counts: {chunks}"
    return ids


@pytest.fixture(scope="module")
def solo(engine, prompt_ids) -> list[list[int]]:
    return [engine.generate(p, max_new_tokens=N_NEW).token_ids for p in prompt_ids]


@pytest.mark.parametrize("prefill_depth, depth", [(1, 1), (8, 3)])
def test_a_batch_gives_each_stream_exactly_its_solo_tokens(engine, prompt_ids, solo, prefill_depth, depth):
    out = engine.generate_batch(prompt_ids, max_new_tokens=N_NEW, prefill_depth=prefill_depth, depth=depth)
    assert [r.token_ids for r in out.results] == solo
    assert out.steps.multi_segment_ops > 0, "streams shared no step op"
    assert engine.in_flight == 0


def test_solo_matches_the_oracle(prompt_ids, solo, oracle_greedy, assert_greedy_matches):
    for i, (p, ids) in enumerate(zip(prompt_ids, solo)):
        ref = oracle_greedy(torch.tensor(p), N_NEW)
        assert_greedy_matches(torch.tensor(ids), ref, f"solo, stream {i}")


def test_batch_results_carry_per_stream_ttft_and_the_aggregate_throughput(engine, prompt_ids):
    out = engine.generate_batch(prompt_ids, max_new_tokens=4)
    assert len(out) == 4 and out.steps.ops > 0
    assert all(r.ttft_s > 0 for r in out.results)
    total = sum(r.n_output_tokens for r in out.results)
    assert out.output_tok_s == pytest.approx(total / out.wall_s)
    assert len(out.stage_busy_s) == 3 and all(b > 0 for b in out.stage_busy_s)


def test_streamed_batch_events_rebuild_every_result(engine, prompt_ids):
    run = engine.stream_batch(prompt_ids[:3], max_new_tokens=6)
    seen: dict[int, list[int]] = {}
    for ev in run:
        seen.setdefault(ev.stream, []).append(ev.token_id)
    result = run.result()
    assert [seen[i] for i in range(3)] == [r.token_ids for r in result.results]


def test_more_prompts_than_rows_queue_for_a_free_row(engine, prompt_ids, solo):
    six = prompt_ids + prompt_ids[:2]
    out = engine.generate_batch(six, max_new_tokens=N_NEW)
    assert [r.token_ids for r in out.results] == solo + solo[:2]


def test_cancelling_one_stream_leaves_its_batch_mates_exact(engine, prompt_ids, solo):
    run = engine.stream_batch(prompt_ids, max_new_tokens=N_NEW)
    for ev in run:
        if ev.stream == 2:
            run.cancel(2)
    results = run.result().results
    assert results[2].finish_reason == "cancelled" and results[2].n_output_tokens == 1
    assert [results[i].token_ids for i in (0, 1, 3)] == [solo[i] for i in (0, 1, 3)]


def test_stage_killed_during_a_batched_prefill_raises_stage_died_within_2s(model_path):
    engine = Engine(model_path, stages=3, prefill_chunk=16, max_rows=4, max_seq_len=512, progress=False)
    pids, names = engine.pids, engine.segment_names
    long_prompt = engine.encode(LONG_TEXT * 4, chat=False)
    outcome: dict = {}

    def run():
        try:
            engine.generate_batch([long_prompt] * 4, max_new_tokens=4, prefill_depth=1)
        except BaseException as exc:  # handed to the main thread
            outcome["exc"] = exc
        outcome["t"] = time.monotonic()

    try:
        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 30
        while engine.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(pids[2], signal.SIGKILL)
        t_kill = time.monotonic()
        worker.join(timeout=10)
        assert isinstance(outcome.get("exc"), StageDied), outcome
        assert outcome["exc"].stage == 2
        assert outcome["t"] - t_kill < 2.0
    finally:
        engine.close()
    deadline = time.monotonic() + 5
    while any(process_start_time(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(process_start_time(p) is None for p in pids)
    assert not set(names) & set(list_segments())
