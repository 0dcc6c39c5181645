"""Logprobs at the last stage (``ringshm.model.head``) and through the scheduler: the values against the transformers
oracle's log-softmax (within 1e-4, prompt positions and the generated one), their bits whatever the chunking,
the batch-mates and the thread count, and the wire (targets forwarded, replies split per segment) on the fake
oracle ring."""

from __future__ import annotations

import pytest
import torch

from fake_stage import EOS, OracleModel, fake_kv, start_fake_ring
from ringshm.engine.engine import new_stream
from ringshm.engine.scheduler import Scheduler
from ringshm.generation_params import GenerationParams
from ringshm.model.head import logprob_rows
from ringshm.transport import messages as m

K = 5
TOL = 1e-4  # issue 14: logprobs equal the oracle's log-softmax within 1e-4


def _want(prompt_logprobs: bool = True, k: int = K) -> int:
    return m.WANT_LAST | m.WANT_LOGPROBS | (m.WANT_PROMPT_LOGPROBS if prompt_logprobs else 0) | m.want_k(k)


@torch.inference_mode()
def test_prompt_and_next_token_logprobs_equal_the_oracle_log_softmax_within_1e_4(full_stage, oracle, prompts,
                                                                                  torch_one_thread):
    for i, prompt in enumerate(prompts):
        full_stage.reset()
        n = len(prompt)
        out = full_stage.step(prompt, [(0, 0, n, _want())], prompt[1:].clone())
        ref = torch.log_softmax(oracle(prompt[None]).logits[0].float(), dim=-1)  # [n, V]
        chosen = torch.cat([prompt[1:], out.token_ids])  # the next prompt id at each position, then the argmax
        assert out.lp_chosen.shape == (n,) and out.lp_top_ids.shape == (n * K,)
        want = ref.gather(1, chosen[:, None])[:, 0]
        err = (out.lp_chosen - want).abs().max().item()
        assert err < TOL, f"prompt {i}: chosen logprobs differ from the oracle's by {err:.3g}"
        top_ids, top = out.lp_top_ids.view(n, K), out.lp_top.view(n, K)
        assert (top[:, :-1] >= top[:, 1:]).all(), "top-k not sorted, most likely first"
        assert (top - ref.topk(K, dim=-1).values).abs().max().item() < TOL
        assert (top - ref.gather(1, top_ids)).abs().max().item() < TOL  # the ids are the oracle's at those values
        # the generated token is the argmax: its logprob is the top entry's
        assert out.lp_chosen[-1].item() == top[-1, 0].item() and out.token_ids.item() == top_ids[-1, 0].item()


def test_logprob_bits_do_not_depend_on_chunking_batch_mates_or_threads(full_stage, prompts):
    prompt = prompts[3]  # 87 tokens
    n = len(prompt)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        full_stage.reset()
        alone = full_stage.step(prompt, [(0, 0, n, _want())], prompt[1:].clone())
        torch.set_num_threads(2)
        full_stage.reset()
        other = prompts[1]
        pieces, cuts = [], [0, 20, 60, n]
        for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
            last = b == n
            want = _want() if last else m.WANT_PROMPT_LOGPROBS | m.want_k(K)
            segs = [(2, 0, len(other), m.WANT_LAST | m.WANT_LOGPROBS | m.want_k(3))] if j == 1 else []
            segs.append((0, a, b - a, want))
            targets = prompt[a + 1: b + (0 if last else 1)]  # the batch-mate scores no targets
            x = torch.cat([other, prompt[a:b]]) if j == 1 else prompt[a:b]
            out = full_stage.step(x, segs, targets.clone())
            lp, ids, top = out.lp_chosen, out.lp_top_ids, out.lp_top
            if j == 1:  # the batch-mate's one position comes first, with k = 3
                lp, ids, top = lp[1:], ids[3:], top[3:]
            pieces.append((lp, ids, top))
    finally:
        torch.set_num_threads(before)
    chunked = [torch.cat([p[i] for p in pieces]) for i in range(3)]
    for a, b, what in zip((alone.lp_chosen, alone.lp_top_ids, alone.lp_top), chunked, ("chosen", "ids", "top")):
        assert torch.equal(a, b), f"{what}: bits differ between one segment and chunks among batch-mates"


def test_logprob_rows_of_one_row_equal_its_bits_among_many():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49152, generator=g) * 4
    chosen = torch.randint(0, 49152, (9,), generator=g)
    many = logprob_rows(logits, chosen, [20] * 9)
    for i in (0, 4, 8):
        one = logprob_rows(logits[i:i + 1].clone(), chosen[i:i + 1], [20])
        assert torch.equal(one[0], many[0][i:i + 1])
        assert torch.equal(one[1], many[1][i * 20:(i + 1) * 20]) and torch.equal(one[2], many[2][i * 20:(i + 1) * 20])


@pytest.mark.parametrize("want", [
    m.WANT_LOGPROBS,  # needs LAST or ALL
    m.WANT_ALL | m.WANT_PROMPT_LOGPROBS,
    m.WANT_LAST | m.WANT_LOGPROBS | (21 << m.WANT_K_SHIFT),
    m.WANT_LAST | m.want_k(3),  # a k without a logprob kind
])
def test_a_bad_logprob_want_is_refused_before_anything_is_written(full_stage, prompts, want):
    with pytest.raises(ValueError, match="LOGPROBS"):
        full_stage.step(prompts[0][:4], [(0, 0, 4, want)])
    assert full_stage.row_length(0) == 0


def test_targets_that_do_not_match_the_table_are_refused(full_stage, prompts):
    with pytest.raises(ValueError, match="target ids"):
        full_stage.step(prompts[0][:4], [(0, 0, 4, m.WANT_PROMPT_LOGPROBS)], prompts[0][1:4].clone()[:2])
    assert full_stage.row_length(0) == 0


# ----------------------------------------------------------------------------------- on the fake ring
SCRIPT = [100] + [10 + (7 * i) % 900 for i in range(199)]


def _run(streams, chunk=4, max_rows=4):
    ring = start_fake_ring(OracleModel([SCRIPT, [101] + SCRIPT[1:]], max_rows=max_rows))
    try:
        events = list(Scheduler(ring.link, streams, max_rows, chunk, 8, 1, chunk, kv=fake_kv(ring.model)))
    finally:
        ring.close()
    return events


def _stream(index, prompt_len, n_new, **kw):
    p = GenerationParams(max_new_tokens=n_new, **kw)
    return new_stream(index, -1, SCRIPT[:prompt_len], p, None, frozenset({EOS}), 1024)


def test_prompt_logprobs_through_the_ring_score_each_next_prompt_id_across_chunks():
    # the fake's logits: 10 at the script's next id, 9 at the id after it, 0 elsewhere
    lse = torch.logsumexp(torch.tensor([10.0, 9.0] + [0.0] * 1022), 0).item()
    s = _stream(0, 11, 3, logprobs=2, prompt_logprobs=1)
    events = _run([s], chunk=4)
    assert [e.token_id for e in events] == SCRIPT[11:14]
    assert s.prompt_token_logprobs[0] is None and len(s.prompt_token_logprobs) == 11
    for i, lp in enumerate(s.prompt_token_logprobs[1:], start=1):
        assert lp.token_id == SCRIPT[i] and lp.logprob == pytest.approx(10 - lse, abs=1e-6)
        assert [t for t, _ in lp.top] == [SCRIPT[i]]
    for e, lp in zip(events, s.token_logprobs):
        assert e.logprob is lp and lp.token_id == e.token_id
        assert [t for t, _ in lp.top] == [e.token_id, e.token_id + 1]
        assert [v for _, v in lp.top] == pytest.approx([10 - lse, 9 - lse], abs=1e-6)


def test_a_sampled_streams_logprobs_come_from_the_raw_logits_it_sampled_from():
    # a logit_bias bans the script's token: the stream takes the next id, whose raw logprob is 9 - lse
    lse = torch.logsumexp(torch.tensor([10.0, 9.0] + [0.0] * 1022), 0).item()
    s = _stream(0, 5, 1, logprobs=0, logit_bias={SCRIPT[5]: -100})
    events = _run([s])
    assert events[0].token_id == SCRIPT[5] + 1
    assert events[0].logprob.logprob == pytest.approx(9 - lse, abs=1e-6) and events[0].logprob.top == ()


def test_logprobs_are_the_same_alone_and_among_batch_mates_on_the_ring():
    alone = _stream(0, 9, 4, logprobs=3, prompt_logprobs=2)
    _run([alone], chunk=3)
    streams = [_stream(i, 9, 4, logprobs=3, prompt_logprobs=2) if i == 2 else _stream(i, 5 + i, 4)
               for i in range(4)]
    _run(streams, chunk=3)
    assert streams[2].token_logprobs == alone.token_logprobs
    assert streams[2].prompt_token_logprobs == alone.prompt_token_logprobs
