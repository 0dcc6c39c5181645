"""Next-token rules and incremental detokenisation (coordinator side, no rings)."""

from __future__ import annotations

import pytest
import torch

from ringshm.engine.sampling import Sampler, TextStream

TEXTS = [
    "Shared memory rings move records between processes. Café, naïve, 東京, emoji 🚀🔥 and ‘quotes’.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\tline ✓",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_decoding_everything_at_once(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ts = TextStream(tokenizer)
    pieces = [ts.push(t) for t in ids]
    pieces.append(ts.finish())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)  # partial UTF-8 is held back, never shown


@pytest.mark.parametrize("stop", ["東京", "🔥", "processes.", "x ** 2"])
def test_stop_string_cuts_the_text_before_it_and_nothing_after_leaks(tokenizer, stop):
    text = next(t for t in TEXTS if stop in t)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ts = TextStream(tokenizer, [stop, "never-appears"])
    shown = ""
    for t in ids:
        shown += ts.push(t)
        if ts.stopped:
            break
    shown += ts.finish()
    assert ts.stopped
    assert shown == text[: text.index(stop)]


def test_greedy_takes_the_argmax_and_sampling_is_reproducible_by_seed():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert Sampler()(int(logits.argmax()), None) == int(logits.argmax())
    a = [Sampler(0.8, 50, 0.9, seed=3)(0, logits) for _ in range(1)]
    s1, s2, s3 = Sampler(0.8, 50, 0.9, seed=3), Sampler(0.8, 50, 0.9, seed=3), Sampler(0.8, 50, 0.9, seed=4)
    draws = [[s(0, logits) for _ in range(20)] for s in (s1, s2, s3)]
    assert draws[0] == draws[1] and draws[0] != draws[2] and a[0] == draws[0][0]


def test_top_k_and_top_p_only_ever_sample_allowed_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0, -2.0])
    top2 = Sampler(1.0, top_k=2, seed=0)
    assert {top2(0, logits) for _ in range(200)} <= {0, 1}
    probs = torch.softmax(logits, -1)  # nucleus: the smallest set reaching top_p
    nucleus = Sampler(1.0, top_p=float(probs[0] + probs[1]) - 1e-6, seed=0)
    assert {nucleus(0, logits) for _ in range(200)} <= {0, 1}


@pytest.mark.parametrize("kw, match", [({"temperature": -1}, "temperature"), ({"top_k": -1}, "top_k"),
                                       ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")])
def test_bad_sampling_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampler(**kw)


# ------------------------------------------------------------------------------------------ logit controls
def test_frequency_and_presence_penalties_subtract_count_times_f_plus_p_over_output_tokens_only():
    s = Sampler(frequency_penalty=0.5, presence_penalty=0.25)
    out = s.process(torch.zeros(6), prompt=[3, 3, 4], output=[1, 1, 2])
    assert torch.equal(out, torch.tensor([0.0, -1.25, -0.75, 0.0, 0.0, 0.0]))  # prompt tokens 3, 4 untouched


@pytest.mark.parametrize("r, expected", [(2.0, [1.0, -4.0, 2.0, -2.0]), (0.5, [4.0, -1.0, 2.0, -2.0])])
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens(r, expected):
    out = Sampler(repetition_penalty=r).process(torch.tensor([2.0, -2.0, 2.0, -2.0]), prompt=[0], output=[1])
    assert torch.equal(out, torch.tensor(expected))


def test_greedy_with_a_control_takes_the_argmax_of_the_processed_logits_not_the_stages():
    logits = torch.tensor([1.0, 3.0, 2.0])
    s = Sampler(logit_bias={1: -100})
    assert s.greedy and s.needs_logits and not Sampler().needs_logits
    assert s(1, logits) == 2
    assert Sampler(frequency_penalty=2.0)(1, logits, [], [1]) == 2  # 3 - 2 < 2
    with pytest.raises(ValueError, match="logits"):
        s(1, None)


def test_a_logit_bias_of_minus_100_is_never_sampled_over_many_seeded_draws():
    logits = torch.tensor([5.0, 4.0, 3.0, 1.0])
    free = Sampler(1.0, seed=0)
    banned = Sampler(1.0, seed=0, logit_bias={0: -100})
    assert 0 in {free(0, logits) for _ in range(200)}  # the top token is drawn without the bias
    assert 0 not in {banned(0, logits) for _ in range(5000)}
    forced = Sampler(1.0, seed=0, logit_bias={3: 100})
    assert {forced(0, logits) for _ in range(500)} == {3}


def test_min_tokens_masks_every_eos_id_until_that_many_tokens_are_generated():
    logits = torch.tensor([0.0, 1.0, 9.0, 8.0, 7.0])  # EOS ids 2 and 3 lead
    s = Sampler(min_tokens=2, eos_ids={2, 3})
    masked = s.process(logits, output=[1])
    assert masked[2] == masked[3] == float("-inf") and torch.equal(masked[[0, 1, 4]], logits[[0, 1, 4]])
    assert s(2, logits, [], []) == 4 and s(2, logits, [], [1]) == 4
    assert s(2, logits, [], [1, 1]) == 2  # two tokens generated: EOS allowed again
    assert not Sampler(min_tokens=2).processes  # no EOS ids: nothing to mask, the argmax stays as is


def test_controls_apply_in_order_penalties_then_logit_bias_then_min_tokens():
    # repetition first: (1 / 2) + 1 = 1.5; bias first would give (1 + 1) / 2 = 1.0
    out = Sampler(repetition_penalty=2.0, logit_bias={0: 1.0}).process(torch.tensor([1.0, 0.0]), output=[0])
    assert out[0] == 1.5
    # min_tokens last: a +100 bias does not unmask EOS
    out = Sampler(logit_bias={1: 100}, min_tokens=1, eos_ids={1}).process(torch.tensor([0.0, 0.0]))
    assert out[1] == float("-inf")
    # temperature after processing: the banned token stays banned at any temperature
    hot = Sampler(2.0, seed=1, logit_bias={0: -100})
    assert 0 not in {hot(0, torch.tensor([9.0, 0.0])) for _ in range(500)}


def test_stop_strings_are_not_looked_for_in_the_first_min_tokens_tokens(tokenizer):
    text = "Hello world. Hello world. Bye."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n_first = next(i for i in range(1, len(ids) + 1) if "world" in tokenizer.decode(ids[:i]))
    for min_tokens, cut in ((0, text.index("world")), (n_first, text.index("world", text.index("world") + 1))):
        ts = TextStream(tokenizer, ["world"], min_tokens)
        shown = ""
        for t in ids:
            shown += ts.push(t)
            if ts.stopped:
                break
        assert ts.stopped and shown + ts.finish() == text[:cut], min_tokens


@pytest.mark.parametrize("kw, match", [
    ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"spec": "ngram", "presence_penalty": 0.5}, "speculative"),
    ({"spec": "ngram", "logit_bias": {5: -100}}, "speculative"), ({"spec": "ngram", "min_tokens": 1}, "speculative"),
])
def test_bad_logit_controls_are_refused_saying_what_to_change(kw, match):
    from ringshm.generation_params import GenerationParams

    with pytest.raises(ValueError, match=match):
        GenerationParams(**kw)


def test_spec_with_ignore_eos_alone_is_allowed_and_logit_bias_ids_are_checked_against_the_vocabulary():
    from ringshm.engine.engine import new_stream
    from ringshm.errors import InvalidParameter
    from ringshm.generation_params import GenerationParams

    assert GenerationParams(spec="ngram", ignore_eos=True).ignore_eos
    p = GenerationParams(logit_bias={1024: -100})
    with pytest.raises(InvalidParameter, match=r"outside the vocabulary \[0, 1024\)") as exc:
        new_stream(0, -1, [1], p, None, frozenset(), vocab=1024)
    assert exc.value.param == "logit_bias"
    assert new_stream(0, -1, [1], p, None, frozenset(), vocab=1025).sampler.needs_logits
