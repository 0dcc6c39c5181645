"""Next-token rules and incremental detokenisation (coordinator side, no rings)."""

from __future__ import annotations

import pytest
import torch

from ringshm.sampling import Sampler, TextStream

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
