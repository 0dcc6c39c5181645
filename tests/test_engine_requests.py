"""Requests on a live 3-stage engine (issue 4): byte-identical invariance over prefill depth and stage count,
streaming, sampling, stop strings, input checks, and a stage error the engine survives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine_prompts import long_user_message
from ringshm.engine.engine import Engine
from ringshm.errors import KVCacheOverflow

ENGINE_KW = dict(prefill_chunk=64, prefill_depth=8, max_rows=2, max_seq_len=1024, progress=False)


@pytest.fixture(scope="module")
def engine3(model_path):
    with Engine(model_path, stages=3, **ENGINE_KW) as eng:
        yield eng


@pytest.fixture(scope="module")
def long_ids(engine3) -> list[int]:
    return engine3.encode(long_user_message(), chat=True)


def test_prefill_depth_1_2_and_8_give_byte_identical_tokens(engine3, long_ids):
    runs = {d: engine3.generate(long_ids, max_new_tokens=12, prefill_depth=d).token_ids for d in (1, 2, 8)}
    assert runs[1] == runs[2] == runs[8], runs


def test_one_stage_and_three_stages_give_byte_identical_tokens(engine3, long_ids, model_path):
    three = engine3.generate(long_ids, max_new_tokens=12).token_ids
    with Engine(model_path, stages=1, **ENGINE_KW) as one_stage:
        one = one_stage.generate(long_ids, max_new_tokens=12).token_ids
    assert one == three


def test_streamed_tokens_and_text_equal_the_result(engine3):
    events = list(engine3.stream("Name a colour.", max_new_tokens=10, chat=True))
    result = engine3.generate("Name a colour.", max_new_tokens=10, chat=True)
    assert [e.token_id for e in events] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    assert engine3.in_flight == 0


def test_callback_sees_every_token_in_order(engine3):
    seen = []
    result = engine3.generate("Count: one, two,", max_new_tokens=6, on_token=seen.append)
    assert [e.token_id for e in seen] == result.token_ids


def test_result_reports_timings_in_the_fields_terms(engine3):
    r = engine3.generate("The sky is", max_new_tokens=8)
    assert r.n_output_tokens == len(r.token_ids) >= 1
    assert r.ttft_s > 0 and r.n_prompt_tokens >= 1
    if r.n_output_tokens > 1:
        assert r.tpot_s > 0 and r.decode_tok_s == pytest.approx(1 / r.tpot_s)
    assert len(r.stage_busy_s) == 3 and all(b > 0 for b in r.stage_busy_s)


def test_same_seed_gives_the_same_sampled_tokens_and_another_seed_differs(engine3):
    kw = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95)
    a = engine3.generate("Once upon a time", seed=7, **kw).token_ids
    b = engine3.generate("Once upon a time", seed=7, **kw).token_ids
    others = [engine3.generate("Once upon a time", seed=s, **kw).token_ids for s in (8, 9)]
    assert a == b
    assert any(o != a for o in others)


def test_stop_string_ends_generation_and_is_cut_from_the_text(engine3):
    free = engine3.generate("List the numbers: 1, 2, 3, 4, 5, 6, 7,", max_new_tokens=12)
    assert len(free.text) > 2
    stop = free.text.strip()[:2]
    cut = engine3.generate("List the numbers: 1, 2, 3, 4, 5, 6, 7,", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert len(cut.token_ids) < len(free.token_ids) or free.finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ([1, 2, 10**6], {}, "outside the vocabulary"),
        ([1, -3], {}, "outside the vocabulary"),
        ([1] * 1000, {"max_new_tokens": 100}, "exceeds max_seq_len"),
        ("hi", {"max_new_tokens": 0}, "max_new_tokens"),
        ("hi", {"prefill_depth": 0}, "prefill_depth"),
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_request_raises_a_clear_value_error_before_anything_is_sent(engine3, prompt, kwargs, match):
    ops_before = engine3.stage_ops()
    with pytest.raises(ValueError, match=match):
        engine3.generate(prompt, **kwargs)
    with pytest.raises(ValueError, match=match):
        engine3.stream(prompt, **kwargs)
    assert engine3.stage_ops() == ops_before
    assert engine3.in_flight == 0


@pytest.mark.parametrize("kwargs, match", [({"prefill_depth": 0}, "prefill_depth"),
                                           ({"prefill_chunk": 0}, "prefill_chunk"),
                                           ({"stages": 0}, "stages"), ({"stages": 31}, "at most 30"),
                                           ({"layer_split": (10, 10)}, "layer_split")])
def test_bad_engine_arguments_raise_before_any_process_starts(model_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Engine(model_path, progress=False, **kwargs)


def test_kv_cache_overflow_raises_a_named_error_and_the_next_request_succeeds(engine3, monkeypatch):
    # Pretend the coordinator allows more positions than the stages' caches hold, so a stage must refuse.
    monkeypatch.setattr(engine3, "max_seq_len", 10**6)
    with pytest.raises(KVCacheOverflow, match="max_seq_len"):
        engine3.generate([1] * 1000, max_new_tokens=100)
    assert engine3.in_flight == 0
    monkeypatch.undo()
    assert engine3.generate("Hello", max_new_tokens=4).n_output_tokens >= 1


def test_cli_json_prints_exactly_one_json_object(model_path):
    out = subprocess.run(
        [sys.executable, "-m", "ringshm.cli", "generate", "--model", str(model_path), "--stages", "2",
         "--max-new-tokens", "5", "--json", "The capital of France is"],
        capture_output=True, text=True, timeout=600, check=True)
    obj = json.loads(out.stdout)
    assert len(obj["token_ids"]) == obj["n_output_tokens"] >= 1
    assert {"text", "ttft_s", "decode_tok_s", "finish_reason", "stages"} <= obj.keys()


def test_cli_bad_input_exits_2_with_a_message(model_path):
    out = subprocess.run([sys.executable, "-m", "ringshm.cli", "generate", "--prefill-depth", "0", "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "prefill_depth" in out.stderr and "Traceback" not in out.stderr


def test_logit_controls_on_the_real_model_ban_a_token_run_past_eos_and_ignore_batch_mates(engine3):
    prompt = "Name a colour."
    first = engine3.generate(prompt, max_new_tokens=4, chat=True).token_ids[0]
    banned = engine3.generate(prompt, max_new_tokens=4, chat=True, logit_bias={first: -100})
    assert banned.token_ids[0] != first
    batch = engine3.generate_batch([prompt, "Count to three."], max_new_tokens=4, chat=True,
                                   logit_bias={first: -100})
    assert batch.results[0].token_ids == banned.token_ids
    long = engine3.generate(prompt, max_new_tokens=24, chat=True, ignore_eos=True)
    assert len(long.token_ids) == 24 and long.finish_reason == "length"
    with pytest.raises(ValueError, match="logit_bias"):
        engine3.generate(prompt, max_new_tokens=4, logit_bias={engine3.model_config.vocab: 1.0})
    assert engine3.in_flight == 0
