"""One client must never hurt another (issue 26): sampling values fp32 cannot carry are refused or mapped up
front, a stream whose own sampling / text / stop work raises fails alone, and stop strings cost linear work.
Fake oracle ring (tests/fake_stage.py) and the sampler itself: runs in seconds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fake_stage import EOS, OracleModel, fake_kv
from ringshm.engine.async_engine import AsyncEngine
from ringshm.engine.engine import new_stream
from ringshm.engine.sampling import Sampler, StopMatcher, TextStream
from ringshm.errors import RequestFailed
from ringshm.generation_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, GenerationParams
from test_serving import FakeEngine, scripts

POISON = 999  # a prompt starting with this id gets a sampler that raises (FakeEngineWithPoison)


class FakeEngineWithPoison(FakeEngine):
    """The fake engine, where a prompt whose second id is ``POISON`` gets a sampler that raises on its first
    token, as NaN logits or a bad value did inside ``torch.multinomial``."""

    def _make_stream(self, index, row, prompt, p):
        s = super()._make_stream(index, row, prompt, p)
        if len(prompt) > 1 and prompt[1] == POISON:
            s.sampler = PoisonedSampler(RuntimeError("probability tensor contains either `inf`, `nan` or "
                                                     "element < 0"))
        return s


class PoisonedSampler(Sampler):
    """A greedy sampler whose choice raises ``exc``."""

    def __init__(self, exc: BaseException):
        super().__init__()
        self.exc = exc

    def __call__(self, *args, **kw):
        raise self.exc


@pytest.fixture
def poison_engine(monkeypatch):
    monkeypatch.setattr("ringshm.model.tokenizer.load_tokenizer", lambda path: None)
    made = []

    def make(ts, **kw):
        aengine = AsyncEngine(FakeEngineWithPoison(OracleModel(ts, max_rows=4, **kw)), 8)
        made.append(aengine)
        return aengine

    yield make
    for aengine in made:
        aengine.close()


# ------------------------------------------------------------------------ one stream's failure is its own
def test_a_stream_whose_sampling_raises_fails_alone_and_its_batch_mates_get_their_bytes(poison_engine):
    ts = scripts(4, length=200)
    poisoned = [ts[3][0], POISON] + ts[3][2:6]
    aengine = poison_engine(ts)

    async def main():
        victims = [asyncio.create_task(aengine.complete(t[:6], 120)) for t in ts[:3]]
        await asyncio.sleep(0.01)  # the victims are decoding when the poisoned request arrives
        bad = await asyncio.gather(aengine.complete(poisoned, 50), return_exceptions=True)
        return await asyncio.gather(*victims, return_exceptions=True), bad[0]

    victims, bad = asyncio.run(main())
    assert isinstance(bad, RequestFailed) and "probability tensor" in str(bad), bad
    for t, r in zip(ts[:3], victims):
        assert not isinstance(r, BaseException), r
        assert r.token_ids == t[6:126] and r.finish_reason == "length"

    async def after():  # the row and blocks of the failed request came back
        return await aengine.complete(ts[3][:6], 20)

    assert asyncio.run(after()).token_ids == ts[3][6:26]
    assert aengine.engine.kv.n_available == aengine.engine.kv.n_blocks


def test_generate_batch_ends_a_failing_stream_with_error_and_finishes_the_others(monkeypatch):
    from fake_stage import start_fake_ring
    from ringshm.engine.scheduler import Scheduler

    ts = scripts(3, length=80)
    model = OracleModel(ts, max_rows=3)
    ring = start_fake_ring(model)
    try:
        streams = [new_stream(i, -1, t[:5], GenerationParams(max_new_tokens=40), None, frozenset({EOS}), 1024)
                   for i, t in enumerate(ts)]

        streams[1].sampler = PoisonedSampler(FloatingPointError("NaN logits"))
        run = Scheduler(ring.link, streams, 3, 4, 8, 1, 8, kv=fake_kv(model))
        events = list(run)
    finally:
        ring.close()
    errors = [e for e in events if e.error is not None]
    assert [e.stream for e in errors] == [1] and isinstance(errors[0].error, FloatingPointError)
    assert streams[1].finish_reason == "error" and streams[1].tokens == []
    for i in (0, 2):
        assert streams[i].tokens == ts[i][5:45] and streams[i].finish_reason == "length"


def test_a_greedy_choice_on_nan_logits_fails_its_stream_alone():
    """The last stage answers NON_FINITE (-1) where a greedy choice's logit is NaN or inf (``head_outputs``): the
    coordinator fails that stream with FloatingPointError, as a sampled stream fails on such logits, and never
    commits -1 as a token (a hostile review saw greedy return token 0 with a NaN logprob); the others finish."""
    from fake_stage import start_fake_ring
    from ringshm.engine.scheduler import Scheduler
    from ringshm.model.head import NON_FINITE

    ts = scripts(3, length=80)
    ts[1][12] = NON_FINITE  # the stage's answer after position 11 of stream 1
    model = OracleModel(ts, max_rows=3)
    ring = start_fake_ring(model)
    try:
        streams = [new_stream(i, -1, t[:5], GenerationParams(max_new_tokens=40), None, frozenset({EOS}), 1024)
                   for i, t in enumerate(ts)]
        events = list(Scheduler(ring.link, streams, 3, 4, 8, 1, 8, kv=fake_kv(model)))
    finally:
        ring.close()
    errors = [e for e in events if e.error is not None]
    assert [e.stream for e in errors] == [1] and isinstance(errors[0].error, FloatingPointError), errors
    assert "greedy choice is NaN or inf" in str(errors[0].error)
    assert streams[1].finish_reason == "error" and streams[1].tokens == ts[1][5:12]
    for i in (0, 2):
        assert streams[i].tokens == ts[i][5:45] and streams[i].finish_reason == "length"


def _one_drafted_stream(pattern: list[int], nan_after, spec, max_new: int):
    """One stream over the fake stage's script ``[100] + pattern * 20`` (the n-gram drafter hits its repeats),
    prompted with its first 20 tokens, whose answer at position ``nan_after(script)`` is NaN logits (NON_FINITE).
    Returns (the script, the stream, its events)."""
    from fake_stage import start_fake_ring
    from ringshm.engine.scheduler import Scheduler
    from ringshm.model.head import NON_FINITE

    script = [100] + pattern * 20
    script[nan_after(script)] = NON_FINITE
    model = OracleModel([script], max_rows=1)
    ring = start_fake_ring(model)
    try:
        s = new_stream(0, -1, script[:20], GenerationParams(max_new_tokens=max_new, spec=spec, spec_k=4), None,
                       frozenset({EOS}), 1024)
        events = list(Scheduler(ring.link, [s], 1, 4, 8, 1, 8, kv=fake_kv(model)))
    finally:
        ring.close()
    return script, s, events


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_a_stream_meeting_nan_logits_keeps_and_streams_plain_greedy_s_tokens_before_them(spec):
    """Speculation commits plain greedy's bytes up to the failure too: a verify whose accepted drafts precede the
    NaN choice commits and streams them, then the stream fails (a review saw spec keep 6 of greedy's 10)."""
    import random

    rng = random.Random(1)
    script, s, events = _one_drafted_stream([rng.randrange(10, 1000) for _ in range(7)], lambda t: 30, spec, 60)
    assert s.tokens == script[20:30] and isinstance(s.error, FloatingPointError), (s.tokens, s.error)
    assert [e.token_id for e in events if e.error is None] == script[20:30]
    assert [type(e.error) for e in events if e.error is not None] == [FloatingPointError]


@pytest.mark.parametrize("spec", [None, "ngram"])
@pytest.mark.parametrize("eos_slot", range(7))
def test_a_stream_that_ends_before_the_nan_choice_ends_as_plain_greedy_does(spec, eos_slot):
    """EOS, then NaN logits at the next position: plain greedy never asks for that choice, so the stream ends by
    EOS, with or without speculation (whose verify may draft through the EOS and compute it: the slots move the
    EOS across the verify's drafts)."""
    import random

    rng = random.Random(1)
    pattern = [rng.randrange(10, 1000) for _ in range(7)]
    pattern[eos_slot] = EOS  # in the prompt too, so the n-gram drafter drafts it

    def after_eos(script):
        return next(p for p in range(20, len(script)) if script[p] == EOS) + 1

    script, s, events = _one_drafted_stream(pattern, after_eos, spec, 40)
    end = after_eos([100] + pattern * 20)
    assert s.tokens == script[20:end] and s.error is None and s.finish_reason == "stop", (s.tokens, s.error)
    assert not [e for e in events if e.error is not None]


def test_a_row_whose_mask_allows_no_token_answers_non_finite_without_failing_its_batch_mates():
    from ringshm.model.head import NON_FINITE, argmax_rows, head_outputs, plan_head
    from ringshm.transport.messages import WANT_ALLOWED, WANT_LAST

    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(0))
    words = torch.full((2, 4), -1, dtype=torch.int32)
    words[1] = 0  # row 1 allows nothing (the grammar refuses such a mask before; the head must not fail the op)
    plan = plan_head([(0, 0, 1, WANT_LAST | WANT_ALLOWED), (1, 0, 1, WANT_LAST | WANT_ALLOWED)], [], words, 100)
    assert head_outputs(logits, plan).token_ids.tolist() == [int(logits[0].argmax()), NON_FINITE]
    assert argmax_rows(logits, words).tolist()[1] == -1


def test_a_nan_embedding_row_makes_only_its_own_row_non_finite_at_the_last_stage(tmp_path):
    """One token's NaN embedding (a broken file, or one a prompt reaches on purpose): the row whose prompt holds
    it gets NON_FINITE from the stage, its batch-mate the id it gets alone."""
    import numpy as np

    from checkpoint_corpus import Tensor, tiny_gguf
    from ringshm.model.head import NON_FINITE
    from ringshm.model.stage_model import StageModel
    from ringshm.transport.messages import WANT_LAST

    f = tiny_gguf()
    emb = f.tensor("token_embd.weight")
    f.tensors.append(Tensor("output.weight", emb.dims, emb.qtype, emb.data))  # untied: the head stays finite
    values = np.frombuffer(emb.data, "<f4").copy().reshape(-1, emb.dims[0])
    values[9] = np.nan
    emb.data = values.tobytes()
    stage = StageModel.from_path(f.write(tmp_path / "nan_row.gguf"), max_rows=2, max_seq_len=16)
    alone = stage.step(torch.tensor([1, 5, 7]), [(1, 0, 3, WANT_LAST)]).token_ids.tolist()
    stage.reset()
    both = stage.step(torch.tensor([1, 5, 9, 1, 5, 7]), [(0, 0, 3, WANT_LAST), (1, 0, 3, WANT_LAST)])
    assert both.token_ids.tolist() == [NON_FINITE] + alone and alone[0] >= 0


# --------------------------------------------------------------------- values fp32 cannot carry, up front
LOGITS = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 8


@pytest.mark.parametrize("kw", [dict(temperature=1e-300), dict(temperature=1e-38), dict(temperature=1e-5),
                                dict(temperature=0.7, top_p=1e-300), dict(temperature=1.0, top_p=1e-45),
                                dict(temperature=100.0, min_tokens=3),
                                dict(temperature=0.5, repetition_penalty=0.01),
                                dict(temperature=0.5, repetition_penalty=100.0)])
def test_every_in_range_sampling_value_samples_a_token_in_fp32(kw):
    p = GenerationParams(max_new_tokens=8, seed=0, **kw)
    s = Sampler(p.temperature, p.top_k, p.top_p, p.seed, repetition_penalty=p.repetition_penalty,
                min_tokens=p.min_tokens, eos_ids=[int(LOGITS.argmax())])
    tokens = [s(0, LOGITS, prompt=list(range(40)), output=[3, 4]) for _ in range(20)]
    assert all(0 <= t < 1000 for t in tokens)
    if p.top_p < 1e-30:  # the nucleus keeps the most likely token only
        assert set(tokens) == {int(LOGITS.argmax())}


def test_a_temperature_below_1e_2_samples_at_1e_2_as_vllm_does():
    assert GenerationParams(temperature=1e-300).temperature == 0.01
    assert GenerationParams(temperature=0.0).temperature == 0.0
    assert GenerationParams(temperature=0.5).temperature == 0.5


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=1e-300), "repetition_penalty must be in"),
    (dict(repetition_penalty=1e-3), "repetition_penalty must be in"),
    (dict(repetition_penalty=1e3), "repetition_penalty must be in"),
    (dict(temperature=1e39), "temperature must be in"),
    (dict(seed=2**64), "seed must be"),
    (dict(seed=-(2**63) - 1), "seed must be"),
    (dict(seed=10**5000), "an int of about 5000 digits"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS}"),
    (dict(stop=["y" * (MAX_STOP_CHARS + 1)]), f"at most {MAX_STOP_CHARS} are allowed"),
])
def test_values_fp32_or_the_caps_cannot_carry_are_refused_before_anything_is_sent(kw, match):
    with pytest.raises(ValueError, match=match):
        GenerationParams(max_new_tokens=8, **kw)


def test_nan_logits_raise_a_clear_error_naming_the_weights():
    logits = LOGITS.clone()
    logits[7] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN / inf .* weights"):
        Sampler(0.8, seed=0)(0, logits)


# ------------------------------------------------------------------------------------------ stop strings
class CharTokenizer:
    """Token id = a character's code point."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def _first_stop(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: before the stop string that ends first (the longest of those ending there)."""
    for end in range(1, len(text) + 1):
        lengths = [len(s) for s in stops if text[:end].endswith(s)]
        if lengths:
            return end - max(lengths)
    return None


def test_stop_strings_cut_at_the_first_to_end_whatever_the_chunking():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        ts = TextStream(CharTokenizer(), stops)
        shown = []
        for ch in text:
            shown.append(ts.push(ord(ch)))
            if ts.stopped:
                break
        shown.append(ts.finish())
        at = _first_stop(text, stops)
        assert "".join(shown) == (text if at is None else text[:at]), (stops, text)
        assert ts.stopped == (at is not None)
        for i in range(len(shown)):  # nothing shown is ever taken back by a later stop string
            assert not any(s in "".join(shown[: i + 1]) for s in stops)


def test_stop_string_work_is_one_automaton_step_per_character(monkeypatch):
    """250 never-matching stop strings of 7,000 characters took 80-185 ms of the dispatcher per token; now the
    list is capped and each new character costs one step of one automaton, whatever the strings."""
    steps = []
    feed = StopMatcher.feed
    monkeypatch.setattr(StopMatcher, "feed", lambda self, ch: steps.append(ch) or feed(self, ch))
    stops = ["x" * (MAX_STOP_CHARS - 1) + str(i) for i in range(MAX_STOP_STRINGS)]
    ts = TextStream(CharTokenizer(), stops)
    text = "x" * 3000
    shown = "".join(ts.push(ord(c)) for c in text)
    assert len(steps) == len(text)  # linear: not len(text) x stops x their length
    assert shown == "x" * (3000 - (MAX_STOP_CHARS - 1))  # what may still become a stop string is held back
    assert ts.finish() == "x" * (MAX_STOP_CHARS - 1)


def test_min_tokens_keeps_stop_strings_out_of_its_text_as_before():
    ts = TextStream(CharTokenizer(), ["ab"], min_tokens=2)
    assert ts.push(ord("a")) == ""  # may still become "ab": held back
    assert ts.push(ord("b")) == "ab"  # "ab" inside the min_tokens text does not stop, and cannot any more
    assert not ts.stopped
    out = ts.push(ord("c")) + ts.push(ord("a")) + ts.push(ord("b"))
    assert ts.stopped and out == "c"

