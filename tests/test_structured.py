"""Structured output (issue 30) on the real model: greedy under a grammar equals transformers fp32 greedy with the
same llguidance mask applied as a logits processor (tie-aware); a constrained stream gets its solo bytes beside
free, sampled and other constrained streams, at 1 and 3 stages, depth 1 and 3, chunked and from the prefix cache;
every finished JSON-schema output validates (``jsonschema`` as the judge); a keyword that cannot be enforced is
refused by name and JSON pointer; the last stage applies each row's own mask."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest
import torch

from ringshm.engine.engine import BatchStream, Engine
from ringshm.engine.grammar import MAX_JSON_WHITESPACE
from ringshm.errors import InvalidParameter
from ringshm.generation_params import GenerationParams
from ringshm.generation_params import StructuredOutput as SO
from ringshm.model.head import argmax_rows, head_outputs, plan_head, unpack_bitmask
from ringshm.model.qmatmul import ISA_NAMES, lib
from ringshm.transport import messages as m

SUPPORTED_ISAS = [i for i in ISA_NAMES if lib.ringshm_isa_supported(i)]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130}},
          "required": ["name", "age"], "additionalProperties": False}
SPECS = {
    "json_schema": SO("json_schema", PERSON),
    "json_object": SO("json_object"),
    "choice": SO("choice", ["yes", "no", "maybe"]),
    "regex": SO("regex", r"[0-9]{3}-[0-9]{4}"),
    "lark": SO("grammar", 'start: "The answer is " ANSWER "."\nANSWER: /(red|green|blue)/'),
    "gbnf": SO("grammar", 'root ::= "Colour: " ("red" | "green" | "blue") "\\n"'),
}
def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


QUESTION = "Describe a person as JSON with a name and an age. Is the sky green? What colour is grass?"
N_NEW = 40


@pytest.fixture(scope="module")
def engine3(model_path):
    with Engine(model_path, stages=3, prefill_chunk=8, max_rows=6, max_seq_len=512, progress=False) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine1(model_path):
    with Engine(model_path, stages=1, max_rows=6, max_seq_len=512, progress=False) as eng:
        yield eng


def _params(spec: SO | None, **kw) -> GenerationParams:
    return GenerationParams(max_new_tokens=kw.pop("max_new_tokens", N_NEW), chat=True, structured_output=spec, **kw)


def _batch(engine, jobs: list[tuple[str, GenerationParams]], depth: int | None = None):
    """Run ``(prompt, params)`` jobs as one batch (each stream its own params); their results in order. Stream i
    of a batch samples with seed + i: each job's seed is offset back, so it samples as it does alone."""
    streams = [engine._make_stream(i, -1, prompt, p if p.seed is None else dataclasses.replace(p, seed=p.seed - i))
               for i, (prompt, p) in enumerate(jobs)]
    run = BatchStream(engine, streams, engine.config.prefill_depth, depth)
    list(run)
    return run.result()


# --------------------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_under_a_grammar_equals_transformers_greedy_with_the_same_mask(engine3, oracle, name,
                                                                               assert_greedy_matches):
    spec = SPECS[name]
    prompt = engine3.encode(QUESTION, chat=True)
    ours = engine3.generate(prompt, N_NEW, structured_output=spec)
    from conftest import masked_greedy

    # the same library's matcher, driven by the oracle's choices
    ref = masked_greedy(oracle, prompt, engine3.grammars.state(spec), N_NEW, engine3.eos_ids)
    tokens = ref.tokens.tolist()
    n = assert_greedy_matches(torch.tensor(ours.token_ids), ref, f"grammar {name}")
    if n == len(tokens):  # no float tie: the same tokens to the end, and the same ending
        assert ours.token_ids == tokens, (ours.text, engine3.tokenizer.decode(tokens))
    if ours.finish_reason == "stop" and name == "choice":
        assert ours.text in ("yes", "no", "maybe")


# --------------------------------------------------------------------------------------- batch invariance
def _mixed_jobs() -> list[tuple[str, GenerationParams]]:
    return [
        (QUESTION, _params(SPECS["json_schema"])),
        ("Write a haiku about the sea.", _params(None)),
        ("Is water wet? Answer yes, no or maybe.", _params(SPECS["choice"])),
        ("Give me a phone number.", _params(SPECS["regex"], temperature=0.9, seed=7)),
        ("Describe a cat as JSON.", _params(SPECS["json_object"], logprobs=2)),
        ("What colour is grass?", _params(SPECS["lark"], temperature=0.7, seed=3, top_k=20)),
        ("What colour is the sky?", _params(SPECS["gbnf"], presence_penalty=0.5)),
    ]


@pytest.fixture(scope="module")
def solo(engine1):
    return [_batch(engine1, [job]).results[0] for job in _mixed_jobs()]


@pytest.mark.parametrize("depth", [1, 3])
def test_constrained_free_and_sampled_streams_in_one_batch_each_get_their_solo_bytes(engine3, solo, depth):
    """1 stage alone vs 3 stages in a batch of 7 (6 rows: one waits), prefill chunks of 8, decode depth 1 and 3,
    and a second run whose prompts come from the prefix cache."""
    for attempt in range(2):
        out = _batch(engine3, _mixed_jobs(), depth)
        assert [r.token_ids for r in out.results] == [s.token_ids for s in solo], f"run {attempt}"
        assert [r.finish_reason for r in out.results] == [s.finish_reason for s in solo]
        assert out.steps.multi_segment_ops > 0
    assert out.results[4].logprobs is not None and [lp.logprob for lp in out.results[4].logprobs] == [
        lp.logprob for lp in solo[4].logprobs]
    assert sum(r.n_cached_tokens for r in out.results) > 0, "the second run's prompts came from the prefix cache"
    assert solo[2].text in ("yes", "no", "maybe") and solo[2].finish_reason == "stop"
    assert json.loads(solo[0].text).keys() == {"name", "age"}


# ------------------------------------------------------------------------------------- the schema corpus
CORPUS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "number", "minimum": -10,
                                                                        "maximum": 10}},
     "required": ["kind", "x"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"$defs": {"pet": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                                        "legs": {"type": "integer", "minimum": 0, "maximum": 8}},
                       "required": ["name", "legs"], "additionalProperties": False}},
     "type": "object", "properties": {"pet": {"$ref": "#/$defs/pet"}}, "required": ["pet"],
     "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"type": "string", "pattern": "^[a-z]{2,5}$"}]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"],
     "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email", "maxLength": 40}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
                                      "score": {"type": "number", "minimum": 0.5, "maximum": 2.5}},
     "required": ["n", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"inner": {"type": "object", "properties": {
        "deep": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, "required": ["deep"],
        "additionalProperties": False}}, "required": ["inner"], "additionalProperties": False},
]


def test_every_finished_json_schema_output_validates_against_its_schema(engine1):
    jobs = [(f"Answer with JSON matching this schema: {json.dumps(s)}", _params(SO("json_schema", s),
                                                                               max_new_tokens=64)) for s in CORPUS]
    results = []
    for i in range(0, len(jobs), 6):  # the engine's 6 rows at a time
        results += _batch(engine1, jobs[i:i + 6]).results
    finished = 0
    for schema, r in zip(CORPUS, results):
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema, format_checker=jsonschema.FormatChecker())
            finished += 1
        else:  # cut by max_new_tokens: a prefix of a valid document, never a finished invalid one
            assert r.finish_reason == "length", r
    assert finished >= len(CORPUS) - 2, [(r.finish_reason, r.text) for r in results]


@pytest.mark.parametrize("schema, keyword, pointer", [
    ({"not": {"type": "string"}}, "not", "/not"),
    ({"type": "object", "properties": {"a": {"if": {"type": "string"}, "then": {"minLength": 2}}}}, "if",
     "/properties/a/if"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems", "/uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains", "/contains"),
    ({"$defs": {"x": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/x"},
     "dependentRequired", "/$defs/x/dependentRequired"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames", "/propertyNames"),
    ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties", "/unevaluatedProperties"),
])
def test_a_keyword_that_cannot_be_enforced_is_refused_naming_it_and_its_pointer(engine1, schema, keyword, pointer):
    with pytest.raises(InvalidParameter, match="cannot enforce") as info:
        engine1.generate("hi", 4, structured_output=SO("json_schema", schema))
    assert keyword in str(info.value) and f"at {pointer}" in str(info.value) and info.value.param == "structured_output"
    assert engine1.in_flight == 0


@pytest.mark.parametrize("spec, says", [
    (SO("json_schema", {"type": 5}), "not valid"),
    (SO("json_schema", {"type": "string", "format": "no-such-format"}), "no-such-format"),
    (SO("regex", "(unclosed"), "unclosed group"),
    (SO("grammar", "start: missing_rule"), "missing_rule"),
    (SO("grammar", 'root ::= ("a" | "b"'), "does not compile"),
    (SO("json_schema", _nested(120)), "nested too deeply"),
])
def test_a_spec_that_does_not_compile_is_refused_and_the_engine_serves_on(engine1, spec, says):
    with pytest.raises(InvalidParameter) as info:
        engine1.generate("hi", 4, structured_output=spec)
    assert says in str(info.value)
    assert engine1.generate("Say hi.", 4, chat=True).n_output_tokens == 4


def test_params_refuse_what_a_grammar_cannot_take_and_malformed_specs():
    GenerationParams(structured_output=SO("json_object"), spec="ngram")  # speculation stays legal
    with pytest.raises(ValueError, match="min_tokens"):
        GenerationParams(structured_output=SO("json_object"), min_tokens=3)
    with pytest.raises(ValueError, match="stop strings"):
        GenerationParams(structured_output=SO("json_object"), stop=["}"])
    for kind, spec in [("yaml", "a"), ("choice", []), ("choice", ["a", ""]), ("regex", ""), ("json_schema", "{x"),
                       ("choice", ["x"] * 1001),
                       ("json_schema", [1]), ("json_object", {"type": "object"}), ("grammar", "x" * 300_000)]:
        with pytest.raises(ValueError):
            SO(kind, spec)
    assert SO("json_schema", {"b": 1, "a": 2}).key() == SO("json_schema", '{"a": 2, "b": 1}').key()


# ----------------------------------------------------------------------------------------- pieces
def test_json_whitespace_is_bounded_per_gap(engine1):
    state = engine1.grammars.state(SO("json_object"))
    space = engine1.tokenizer.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    state.accept(engine1.tokenizer.encode("{", add_special_tokens=False)[0])
    n = 0
    while bool(state.allowed()[space[0]]) and n < 200:
        state.accept(space[0])
        n += 1
    assert n == MAX_JSON_WHITESPACE


def test_a_compiled_grammar_is_cached_and_streams_get_their_own_state(engine1):
    g = engine1.grammars
    spec = SO("regex", "(abc|xyz)")
    a = g.state(spec)
    hits, compiled = g.n_cache_hits, g.n_compiled
    b = g.state(SO("regex", "(abc|xyz)"))
    assert (g.n_cache_hits, g.n_compiled) == (hits + 1, compiled)
    tok = engine1.tokenizer.encode("a", add_special_tokens=False)[0]
    a.accept(tok)
    assert not torch.equal(a.words(), b.words()), "accepting in one stream moved the other"


def test_the_last_stage_restricts_each_rows_argmax_by_that_rows_own_mask():
    vocab = 70
    logits = torch.randn(3, vocab)
    segs = [m.Segment(0, 0, 2, m.WANT_LAST | m.WANT_ALLOWED), m.Segment(1, 5, 1, m.WANT_LAST),
            m.Segment(2, 3, 1, m.WANT_LAST | m.WANT_ALLOWED | m.WANT_LOGPROBS | m.want_k(2))]
    words = torch.zeros(2, 3, dtype=torch.int32)
    allowed = [[5, 41, 69], [0, 33]]
    for r, toks in enumerate(allowed):
        for t in toks:
            words[r, t // 32] |= 1 << (t % 32)
    assert unpack_bitmask(words, vocab).nonzero().tolist() == [[r, t] for r, ts in enumerate(allowed) for t in ts]
    hidden_rows = torch.zeros(4, vocab)
    hidden_rows[1], hidden_rows[2], hidden_rows[3] = logits  # position 0 is not an output
    plan = plan_head(segs, [], words, vocab)
    out = head_outputs(hidden_rows[plan.positions], plan)
    ids = out.token_ids.tolist()
    assert ids[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
    assert ids[1] == int(logits[1].argmax())
    assert ids[2] == max(allowed[1], key=lambda t: float(logits[2, t]))
    assert float(out.lp_chosen[0]) == float(torch.log_softmax(logits[2], -1)[ids[2]])  # raw model logprobs
    with pytest.raises(ValueError, match="int32 \\[2, 3\\]"):
        plan_head(segs, [], words[:1], vocab)
    with pytest.raises(ValueError, match="int32 \\[2, 3\\]"):
        plan_head(segs, [], None, vocab)


@pytest.mark.parametrize("levels", [12, 300])
@pytest.mark.parametrize("density", [0.0005, 0.02, 0.3, 0.97])
def test_the_restricted_argmax_equals_the_masked_argmax_ties_included(density, levels):
    """The head's restricted argmax (the C kernel ``ringshm_argmax_rows``) against ``masked_fill(-inf).argmax()``,
    sparse to dense masks, on logits with many exact ties (small integers), a vocabulary that ends mid-word."""
    gen = torch.Generator().manual_seed(int(density * 1e4) + levels)
    vocab, n = 5000, 64  # 157 words: sparse masks (<= 64 nonzero words) and dense ones
    logits = torch.randint(0, levels, (n, vocab), generator=gen).float()
    ok = torch.rand(n, vocab, generator=gen) < density
    ok[torch.arange(n), torch.randint(0, vocab, (n,), generator=gen)] = True  # at least one allowed per row
    padded = torch.zeros(n, -(-vocab // 32) * 32, dtype=torch.int64)
    padded[:, :vocab] = ok.long()
    words = (padded.view(n, -1, 32) << torch.arange(32)).sum(dim=-1)  # bit t % 32 of word t // 32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert torch.equal(unpack_bitmask(words, vocab), ok)
    segs = [m.Segment(i, 0, 1, m.WANT_LAST | m.WANT_ALLOWED) for i in range(n)]
    out = head_outputs(logits, plan_head(segs, [], words, vocab))
    want = logits.masked_fill(~ok, float("-inf")).argmax(dim=-1).tolist()
    assert out.token_ids.tolist() == want
    for isa in SUPPORTED_ISAS:  # every path the kernel has, not only this CPU's best
        assert argmax_rows(logits, words, isa).tolist() == want, ISA_NAMES[isa]


def test_the_argmax_kernel_keeps_torchs_rules_for_nan_inf_and_ties():
    """``argmax_rows`` without a mask equals ``torch.argmax`` (the first NaN wins, ties go to the smallest index,
    -inf rows give 0), and with one, ``masked_fill(-inf).argmax()`` wherever an allowed logit is finite; the
    documented difference: every allowed logit at -inf gives the first allowed token; none allowed gives -1."""
    gen = torch.Generator().manual_seed(7)
    vocab = 1000
    logits = torch.randint(0, 5, (8, vocab), generator=gen).float()
    logits[1, 700] = float("nan")
    logits[1, 900] = float("nan")
    logits[2] = float("-inf")
    logits[3, 999] = 50.0  # the last token, in the last partial word
    logits[4, :500] = float("inf")
    logits[5:7] = -1.0  # +0 and -0 compare equal: the first of the two is the argmax, in either order
    logits[5, 10], logits[5, 20], logits[6, 10], logits[6, 20] = -0.0, 0.0, 0.0, -0.0
    for isa in [-1, *SUPPORTED_ISAS]:
        assert argmax_rows(logits, None, isa).tolist() == logits.argmax(dim=-1).tolist(), isa
    ok = torch.rand(8, vocab, generator=gen) < 0.5
    ok[:, 3] = True
    ok[1, 700] = False  # a refused NaN does not win
    padded = torch.zeros(8, 1024, dtype=torch.int64)
    padded[:, :vocab] = ok.long()
    words = (padded.view(8, -1, 32) << torch.arange(32)).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    want = logits.masked_fill(~ok, float("-inf")).argmax(dim=-1).tolist()
    for isa in [-1, *SUPPORTED_ISAS]:
        got = argmax_rows(logits, words, isa).tolist()
        assert got[:2] + got[3:] == want[:2] + want[3:] and got[1] == 900, isa
        assert got[2] == int(ok[2].nonzero()[0, 0]), isa  # all allowed at -inf: the first allowed (masked_fill: 0)
    words[5] = 0
    assert argmax_rows(logits, words)[5] == -1


def test_speculative_decoding_under_a_grammar_commits_the_plain_constrained_tokens(engine3):
    """n-gram drafts from a prompt that holds the answer: most are accepted, some are cut by the grammar, and every
    verified position carries its own mask; the tokens equal plain constrained greedy decoding."""
    record = {"name": "Ada Lovelace", "age": 36}
    prompt = f"Copy this JSON exactly: {json.dumps(record)}. Now copy it again: {json.dumps(record)}"
    for spec in (SPECS["json_schema"], SO("json_object"), SO("regex", r"\{[^}]*\}")):
        plain = engine3.generate(prompt, N_NEW, chat=True, structured_output=spec)
        fast = engine3.generate(prompt, N_NEW, chat=True, structured_output=spec, spec="ngram", spec_k=6)
        assert fast.token_ids == plain.token_ids and fast.finish_reason == plain.finish_reason, spec.kind
        assert fast.draft_tokens > 0 and fast.acceptance_rate > 0.3, (spec.kind, fast)


def test_draft_masks_walk_the_grammar_and_leave_its_state_unchanged(engine1):
    tok = engine1.tokenizer
    state = engine1.grammars.state(SO("regex", "(abc|xyz)!"))
    drafts = tok.encode("abc!zz", add_special_tokens=False)
    before = state.words().clone()
    kept, masks = state.draft_masks(drafts)
    assert tok.decode(kept) == "abc!" and len(masks) == len(kept) + 1
    assert torch.equal(masks[0], before) and torch.equal(state.words(), before)
    walk = engine1.grammars.state(SO("regex", "(abc|xyz)!"))
    for token, mask in zip(kept, masks):
        assert torch.equal(walk.words(), mask)
        walk.accept(token)
    assert torch.equal(walk.words(), masks[-1]) and walk.stopped


def test_a_grammar_that_cannot_go_on_fails_its_own_stream_and_no_other(engine1, solo, monkeypatch):
    """The masks are computed as each op goes out (the MASKS record behind it): the first constrained stream's
    third mask "allows nothing"; that stream ends with the error, every other keeps its solo bytes."""
    import ringshm.engine.grammar as grammar

    real = grammar.GrammarState.words
    calls: dict[int, int] = {}
    first: list[int] = []

    def words(self):
        if self._words is None:
            first[:] = first or [id(self)]
            calls[id(self)] = calls.get(id(self), 0) + 1
            if id(self) == first[0] and calls[id(self)] == 3:
                raise InvalidParameter("the structured output cannot go on: no token is allowed here",
                                       "structured_output")
        return real(self)

    monkeypatch.setattr(grammar.GrammarState, "words", words)
    jobs = _mixed_jobs()
    out = _batch(engine1, jobs)
    failed = [i for i, r in enumerate(out.results) if r.finish_reason == "error"]
    assert failed == [0], "the first constrained stream (greedy: its masks go out behind its ops) fails alone"
    assert "cannot go on" in out.results[failed[0]].error
    for i, (r, s) in enumerate(zip(out.results, solo)):
        if i not in failed:
            assert r.token_ids == s.token_ids, i
    assert engine1.generate("Say hi.", 4, chat=True).n_output_tokens == 4


class _Interrupt(BaseException):
    """Stands in for a KeyboardInterrupt (which pytest would take for its own)."""


def test_an_interrupt_while_the_masks_are_computed_still_sends_them_and_the_engine_serves_on(engine1, solo,
                                                                                            monkeypatch):
    """The op is out when its masks are computed: whatever interrupts that, its MASKS record still goes out (else
    the last stage would hold the op, and the link refuse every send, until the ring timeout)."""
    import ringshm.engine.grammar as grammar

    real = grammar.GrammarState.words
    calls = [0]

    def words(self):
        if self._words is None:
            calls[0] += 1
            if calls[0] == 3:
                raise _Interrupt()
        return real(self)

    monkeypatch.setattr(grammar.GrammarState, "words", words)
    with pytest.raises(_Interrupt):
        _batch(engine1, _mixed_jobs()[:1])
    monkeypatch.setattr(grammar.GrammarState, "words", real)
    assert engine1._link.owed is None
    assert _batch(engine1, _mixed_jobs()[:1]).results[0].token_ids == solo[0].token_ids


def test_a_compile_that_runs_over_its_time_is_refused_remembered_and_bounded(engine1, monkeypatch):
    """llguidance's limits do not bound every grammar (``start: X X "b"`` with ``X: "a"+`` computes its first mask
    forever): a compile gets ``COMPILE_TIMEOUT_S``; one that runs over is refused and remembered, and after
    ``MAX_STUCK_COMPILES`` of them every compile is refused. Simulated with a build that sleeps (a real one would
    keep a core busy for the rest of the run)."""
    import threading

    import ringshm.engine.grammar as grammar

    compiler = grammar.GrammarCompiler(engine1.tokenizer, engine1.model_config.vocab, engine1.eos_ids)
    release = threading.Event()
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(compiler, "_build", lambda spec: release.wait(30))
    for i in range(grammar.MAX_STUCK_COMPILES):
        with pytest.raises(InvalidParameter, match="takes more than 0.2 s"):
            compiler.compile(SO("regex", f"slow{i}"))
    with pytest.raises(InvalidParameter, match="takes more than"):  # remembered: refused at once
        compiler.compile(SO("regex", "slow0"))
    with pytest.raises(InvalidParameter, match="unavailable"):
        compiler.compile(SO("regex", "fine"))
    release.set()
