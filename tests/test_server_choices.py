"""Issue 14's fields through the official ``openai`` client, on one in-process server over the fake oracle ring
(tests/test_server_abuse.py's, real tokenizer) for the module: logprobs and top_logprobs (chat), logprobs, echo
and ``max_tokens`` 0 (completions), ``n`` and prompt lists, streaming and not, each with exact expectations
(the fake's logits are 10 at its answer, 9 at the id after it, 0 elsewhere: every logprob is known), and the
bad values that get a 400 naming the field. The real model against the oracle is tests/test_server_logprobs.py."""

from __future__ import annotations

import openai
import pytest
import torch

from ringshm.server.openai_responses import TokenText
from test_server_abuse import MODEL_ID, GatedModel, LiveServer, ServerEngine, _error, _script

VOCAB = 1024  # the fake's
A, B = _script(100), _script(101)


def lp(answer: int) -> tuple[float, float]:
    """The logprobs of the fake's answer and of the id after it: the stage's fp32 bits for that row (the sum
    inside log-softmax runs in SIMD lanes, so where the 10 sits moves the last bit)."""
    row = torch.zeros(VOCAB)
    row[answer], row[answer + 1] = 10.0, 9.0
    out = torch.log_softmax(row, dim=-1)
    return out[answer].item(), out[answer + 1].item()


TOP1, TOP2 = lp(0)


@pytest.fixture(scope="module")
def srv(model_path):
    server = LiveServer(ServerEngine(GatedModel([A, B], max_rows=4), model_path), max_waiting=16)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tt(srv) -> TokenText:
    return TokenText(srv.aengine.engine.tokenizer)


def _chat_tokens(srv, n_new: int) -> list[int]:
    """What the fake answers a chat: its template's ids are no script, so every answer is WRONG (0)."""
    return [0] * n_new


# ------------------------------------------------------------------------------------------ chat logprobs
@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_give_each_tokens_logprob_and_its_top_logprobs_in_order(srv, client, tt, stream):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0,
              logprobs=True, top_logprobs=2)
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert (entry.token, entry.logprob, entry.bytes) == (tt.text(0), TOP1, list(tt.bytes(0)))
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(tt.text(0), TOP1), (tt.text(1), TOP2)]


def test_chat_logprobs_without_top_logprobs_give_empty_top_lists_and_none_without_logprobs(client):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    r = client.chat.completions.create(logprobs=True, **kw)
    assert [e.top_logprobs for e in r.choices[0].logprobs.content] == [[], []]
    assert client.chat.completions.create(**kw).choices[0].logprobs is None


# ------------------------------------------------------------------------------------ completions logprobs
def _completion(client, stream: bool, **kw):
    """(text, tokens, token_logprobs, top_logprobs, text_offset, finish_reason) of choice 0."""
    kw = dict(model=MODEL_ID, temperature=0, **kw)
    if not stream:
        c = client.completions.create(**kw).choices[0]
        lp = c.logprobs
        return c.text, lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, c.finish_reason
    text, tokens, lps, tops, offsets, finish = "", [], [], [], [], None
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                lps += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    return text, tokens, lps, tops, offsets, finish


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_list_tokens_logprobs_top_dicts_and_offsets(client, tt, stream):
    prompt = A[:6]
    text, tokens, lps, tops, offsets, finish = _completion(client, stream, prompt=prompt, max_tokens=4, logprobs=2)
    new = A[6:10]
    assert text == "".join(tt.text(t) for t in new) and finish == "length"
    assert tokens == [tt.text(t) for t in new] and lps == [lp(t)[0] for t in new]
    assert tops == [{tt.text(t): lp(t)[0], tt.text(t + 1): lp(t)[1]} for t in new]
    assert offsets == [sum(len(tt.text(t)) for t in new[:i]) for i in range(4)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo_with_logprobs_scores_the_prompt_first_token_null(client, tt, stream, max_tokens):
    prompt = A[:7]  # 7 tokens: chunked by the fake engine's prefill_chunk of 4
    text, tokens, lps, tops, offsets, finish = _completion(client, stream, prompt=prompt, max_tokens=max_tokens,
                                                           logprobs=1, echo=True)
    ids = A[:7 + max_tokens]
    assert text == tt.tokenizer.decode(prompt) + "".join(tt.text(t) for t in A[7:7 + max_tokens])
    assert tokens == [tt.text(t) for t in ids] and finish == "length"
    assert lps == [None] + [lp(t)[0] for t in ids[1:]]
    assert tops[0] is None and tops[1:] == [{tt.text(t): lp(t)[0]} for t in ids[1:]]
    assert offsets == [sum(len(tt.text(t)) for t in ids[:i]) for i in range(len(ids))]


def test_echo_with_max_tokens_0_counts_no_completion_tokens(client):
    r = client.completions.create(model=MODEL_ID, prompt=A[:5], max_tokens=0, echo=True, logprobs=0)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 0
    assert r.choices[0].logprobs.token_logprobs == [None] + [lp(t)[0] for t in A[1:5]]


def test_echo_without_logprobs_prepends_the_prompt_text(client, tt):
    r = client.completions.create(model=MODEL_ID, prompt="Hello there", max_tokens=1, echo=True, temperature=0)
    assert r.choices[0].text.startswith("Hello there") and r.choices[0].logprobs is None


# --------------------------------------------------------------------------------------- n, prompt lists
@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_with_n_answers_prompt_major_choices_in_index_order(client, tt, stream):
    kw = dict(model=MODEL_ID, prompt=[A[:4], B[:5]], max_tokens=3, n=2, temperature=0.7, seed=5)
    texts: dict[int, str] = {}
    if stream:
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
        indexes = sorted(texts)
    else:
        r = client.completions.create(**kw)
        indexes = [c.index for c in r.choices]
        texts = {c.index: c.text for c in r.choices}
        assert r.usage.prompt_tokens == 4 + 5 and r.usage.completion_tokens == 4 * 3
    assert indexes == [0, 1, 2, 3]
    want_a, want_b = "".join(tt.text(t) for t in A[4:7]), "".join(tt.text(t) for t in B[5:8])
    assert [texts[i] for i in range(4)] == [want_a, want_a, want_b, want_b]


@pytest.mark.parametrize("prompt", [["Hi", "Bye"], [[100, 110], [101]]])
def test_prompt_lists_of_strings_or_of_id_lists_each_get_a_choice(client, prompt):
    r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=1, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_n_answers_n_identical_choices_from_one_stream(srv, client, stream):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, n=3,
              logprobs=True)
    if stream:
        texts, lps = {}, {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                if c.logprobs is not None:
                    lps[c.index] = lps.get(c.index, []) + [e.logprob for e in c.logprobs.content]
        assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 1
        assert lps == {i: [TOP1] * 3 for i in range(3)}
    else:
        r = client.chat.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert len({c.message.content for c in r.choices}) == 1
        assert r.usage.completion_tokens == 9


# ------------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"logprobs": 5, "n": 17}, "n"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 16, "temperature": 1.0, "prompt": [[100], [101]]}, "n"),  # 32 rows > 4 + 16
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[100], []]}, "prompt"),
    ("/v1/completions", {"logit_bias": {"1024": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": ["hi", [100]]}, "prompt"),  # strings and id lists mixed
    ("/v1/completions", {"seed": 2**63}, "seed"),  # int64, as vLLM
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options"),
    ("/v1/completions", {"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
])
def test_a_bad_value_gets_400_naming_the_field_before_anything_runs(srv, path, body, param):
    ops = srv.aengine.engine.stage_ops()[0]
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": [100, 110]}
    status, parsed, _ = srv.post(path, {**base, "max_tokens": 2, **body})
    assert status == 400 and _error(parsed)["param"] == param, parsed
    assert srv.aengine.engine.stage_ops()[0] == ops  # nothing reached the stage


# ---------------------------------------------------------------------------------------------- metrics
def test_logprob_requests_and_prompt_logprob_tokens_are_counted(srv, client):
    def metric(name):
        _, text, _ = srv.get("/metrics")
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

    requests, tokens = metric("ringshm_logprob_requests_total"), metric("ringshm_prompt_logprob_tokens_total")
    client.completions.create(model=MODEL_ID, prompt=A[:6], max_tokens=1, echo=True, logprobs=1)
    client.completions.create(model=MODEL_ID, prompt=A[:6], max_tokens=1)
    client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                   logprobs=True)
    assert metric("ringshm_logprob_requests_total") == requests + 2
    assert metric("ringshm_prompt_logprob_tokens_total") == tokens + 5


def test_an_explicit_null_is_the_fields_default(srv):
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "stream_options", "presence_penalty",
                               "frequency_penalty", "seed", "stop", "echo", "logprobs", "min_tokens", "ignore_eos",
                               "top_k", "repetition_penalty", "return_tokens_as_token_ids", "logit_bias")}
    status, parsed, _ = srv.post("/v1/completions", {"prompt": [100, 110], "max_tokens": 2, **nulls})
    assert status == 200, parsed
    assert len(parsed["choices"]) == 1 and parsed["choices"][0]["logprobs"] is None


def test_two_ids_with_the_same_text_keep_the_likelier_in_completions_top_logprobs():
    from ringshm.engine.logprobs import TokenLogprob
    from ringshm.server.openai_responses import OpenAIRequest

    class SameText:  # ids 5 and 6 both read "x" (say, two partial UTF-8 tokens)
        def text(self, t):
            return "x" if t in (5, 6) else f"t{t}"

        def bytes(self, t):
            return self.text(t).encode()

    answer = OpenAIRequest.__new__(OpenAIRequest)
    answer.kind, answer.tt, answer.tokens_as_ids = "completion", SameText(), False
    choice = type("C", (), {"offset": 0})()
    out = answer._payload(choice, [6], [TokenLogprob(6, -2.0, [(7, -0.5), (5, -1.0), (6, -2.0)])])
    assert out["top_logprobs"] == [{"t7": -0.5, "x": -1.0}]  # not -2.0: the dict stays sorted, the likelier kept
    assert out["token_logprobs"] == [-2.0]


def test_finish_reasons_count_per_choice_and_scoring_generates_no_token(srv, client):
    def metric(name):
        _, text, _ = srv.get("/metrics")
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    length = 'ringshm_request_finished_total{finish_reason="length"}'
    finished, generated, prompt = metric(length), metric("ringshm_generation_tokens_total"), metric(
        "ringshm_prompt_tokens_total")
    client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   temperature=0, n=3)
    assert metric(length) == finished + 3  # one greedy stream answers three choices: three finish
    client.completions.create(model=MODEL_ID, prompt=A[:6], max_tokens=0, echo=True, logprobs=1)
    assert metric("ringshm_generation_tokens_total") == generated + 2  # the chat's stream; scoring returns none
    client.completions.create(model=MODEL_ID, prompt=A[:6], max_tokens=1, temperature=1.0, seed=1, n=2)
    assert metric("ringshm_prompt_tokens_total") > prompt
    before = metric("ringshm_prompt_tokens_total")
    client.completions.create(model=MODEL_ID, prompt=A[:6], max_tokens=1, temperature=1.0, seed=1, n=2)
    assert metric("ringshm_prompt_tokens_total") == before + 6  # the prompt once, as usage counts it
