"""Tool calls in the model's own format (issue 30): zoo models whose chat templates declare one
(``tests/tool_templates.py``: hermes on qwen2, llama3_json on llama3, mistral on mistral), served by ``LiveServer``
over a real 2-stage ``Engine`` and driven with the ``openai`` client: the format is found from the template, the tools
reach the prompt through the template, calls come back parsed (ids as the format needs), a stream concatenates to the
body, a round trip (call, result, answer) renders; greedy under the format's grammar equals transformers fp32 greedy
with the same mask; and each format's grammar and reader are checked on written answers (text before a call for
``auto``, none for ``required``) at every cut."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
import torch

from ringshm.engine.engine import Engine
from ringshm.model.tokenizer import encode_chat, load_tokenizer
from ringshm.server.tool_formats import FORMATS, ToolCallStream, detect_format, make_format
from ringshm.server.tools import tool_plan
from test_server_abuse import LiveServer
from tool_templates import SPECS, tool_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=sorted(SPECS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(family, tmp_path_factory):
    return tool_model(family, tmp_path_factory.mktemp(f"tools-{family}"))


@pytest.fixture(scope="module")
def srv(model):
    server = LiveServer(Engine(model.hf_dir, stages=2, max_rows=4, max_seq_len=1024, progress=False),
                        model_names="zoo", max_waiting=16)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)


def _ask(client, messages=ASK, **kw):
    return client.chat.completions.create(model="zoo", messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 160), **kw)


def _check_calls(family: str, calls, names: set[str]) -> None:
    for c in calls:
        assert c.function.name in names, c
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
        assert re.fullmatch("[A-Za-z0-9]{9}" if family == "mistral" else "call_[0-9a-f]{24}", c.id), c.id


def test_the_format_comes_from_the_chat_template(model, family):
    tok = load_tokenizer(model.hf_dir)
    assert detect_format(tok.chat_template) == SPECS[family][0]
    assert detect_format(load_tokenizer(model.hf_dir).chat_template.replace("tools", "tool_list")) == "generic"
    fmt = make_format(SPECS[family][0], tok)
    # llguidance holds qwen's <tool_call> as a token (an added "<...>" token), though decoding keeps its text
    tokens = {"qwen2": {"<tool_call>", "</tool_call>"}, "mistral": {"[TOOL_CALLS]"}}
    assert set(fmt.special) == tokens.get(family, set())
    assert set(fmt.marker_ids.values()) == ({"[TOOL_CALLS]"} if family == "mistral" else set())


@pytest.mark.parametrize("tool_choice, names", [
    ("required", {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "add"}}, {"add"}),
])
def test_required_and_named_choices_answer_with_calls_that_validate(client, family, tool_choice, names):
    out = _ask(client, tool_choice=tool_choice)
    choice = out.choices[0]
    assert choice.finish_reason in ("tool_calls", "length"), choice
    assert choice.message.tool_calls, choice
    if choice.finish_reason == "tool_calls":
        _check_calls(family, choice.message.tool_calls, names)
    assert choice.message.content is None, "a required call leaves no room for text"


def _collect(stream):
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        content += d.content or ""
        for t in d.tool_calls or ():
            call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = call["id"] or t.id
            call["name"] += t.function.name or ""
            call["arguments"] += t.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_a_stream_concatenates_to_the_body(client, tool_choice):
    whole = _ask(client, tool_choice=tool_choice).choices[0]
    content, calls, finish = _collect(_ask(client, tool_choice=tool_choice, stream=True))
    assert finish == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert all(c["id"] for c in calls)


def test_a_round_trip_renders_through_the_template(client, family):
    first = _ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 parallel_tool_calls=False).choices[0].message
    assert len(first.tool_calls) == 1
    result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temperature": 18}'}
    messages = ASK + [first.model_dump(exclude_none=True), result]
    out = _ask(client, messages, tool_choice="auto", max_tokens=24).choices[0]
    assert out.finish_reason in ("stop", "length", "tool_calls")
    bad = [dict(result, tool_call_id="call_x")]  # mistral's template refuses an id that is not 9 characters
    if family == "mistral":
        with pytest.raises(openai.BadRequestError):
            _ask(client, messages[:-1] + bad, max_tokens=4)


def test_a_tool_that_spells_a_special_token_is_refused(srv, family):
    special = SPECS[family][2][0]
    tool = {"type": "function", "function": {"name": "f", "description": f"ends {special} here"}}
    status, out, _ = srv.post("/v1/chat/completions", {"model": "zoo", "messages": ASK, "tools": [tool],
                                                       "max_tokens": 4})
    assert status == 400 and out["error"]["param"] == "tools" and special in out["error"]["message"], out
    call = {"id": f"c{special}", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    for turns in ([{"role": "assistant", "tool_calls": [call]}],
                  [{"role": "tool", "tool_call_id": f"x{special}", "content": "1"}]):
        status, out, _ = srv.post("/v1/chat/completions", {"model": "zoo", "messages": ASK + turns, "max_tokens": 4})
        assert status == 400 and out["error"]["param"] == "messages" and special in out["error"]["message"], out


def test_greedy_under_the_format_equals_transformers_greedy_with_the_same_mask(srv, model, family,
                                                                                assert_greedy_matches):
    """The format's grammar (``required``: the answer is calls only) through the ring equals transformers fp32
    greedy with the same llguidance mask applied as a logits processor, token for token up to a float tie."""
    from conftest import masked_greedy

    engine = srv.aengine.engine
    plan = tool_plan(TOOLS, "required", None, make_format(SPECS[family][0], engine.tokenizer))
    spec = plan.constraint()
    prompt = encode_chat(engine.tokenizer, ASK, tools=plan.template_tools())
    n_new = 60

    async def ours():
        return [c.token_id async for c in srv.aengine.stream(prompt, n_new, structured_output=spec)]

    tokens_ours = asyncio.run(ours())
    ref = masked_greedy(model.oracle(), prompt, engine.grammars.state(spec), n_new, engine.eos_ids)
    tokens = ref.tokens.tolist()
    n = assert_greedy_matches(torch.tensor(tokens_ours), ref, f"{family} tool grammar")
    if n == len(tokens):
        assert tokens_ours == tokens


# ------------------------------------------------------------------------------------ grammars and readers
ANSWERS = {  # format -> (auto answer with text before / instead of calls, required answer)
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    "llama3_json": ("Paris is sunny {mostly}.", '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
    "mistral": ("It is sunny [TOOL] in Paris.", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    "generic": ('{"content": "It is \\"sunny\\"."}',
                '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}'),
}


@pytest.mark.parametrize("name, family", [(n, None) for n in FORMATS] + [("hermes", "qwen2"), ("mistral", "mistral")])
def test_each_formats_grammar_takes_its_answers_and_refuses_text_where_a_call_is_required(name, family, tokenizer):
    """On the default model's tokenizer (no marker is a token there) and on tokenizers whose markers are tokens
    (qwen's ``<tool_call>``, mistral's special ``[TOOL_CALLS]``): ``auto`` takes text (before a call where the format
    allows it) and calls; ``required`` refuses text and takes a call; a call of an unknown tool is refused; text
    that spells a token marker without the token is refused."""
    from ringshm.engine.grammar import GrammarCompiler
    from tool_templates import build_tokenizer

    tok = tokenizer if family is None else build_tokenizer(family)
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    fmt = make_format(name, tok)
    assert bool(fmt.special) == (family is not None)

    def takes(choice: str, text: str | list[int]) -> bool:
        plan = tool_plan(TOOLS, choice, None, fmt)
        matcher = compiler.compile(plan.constraint()).deep_copy()
        ids = text if isinstance(text, list) else tok(text, add_special_tokens=False)["input_ids"]
        ok = matcher.consume_tokens(ids)
        return bool(ok) and not matcher.is_error() and matcher.is_accepting()

    auto, required = ANSWERS[name]
    assert takes("auto", auto) and takes("auto", required) and takes("required", required)
    assert not takes("required", auto)
    assert not takes("required", required.replace('"add"', '"sub"'))
    if fmt.special:  # text may not spell the marker where the reader would take it for one (mistral: at the start)
        marker = next(iter(fmt.special))
        spelled = [i for ch in marker for i in tok(ch, add_special_tokens=False)["input_ids"]]
        before = [] if name == "mistral" else tok("Hi ", add_special_tokens=False)["input_ids"]
        assert not takes("auto", before + spelled + tok(" x", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("which", [0, 1])
def test_each_formats_reader_streams_what_the_body_returns_at_every_cut(name, which):
    """``ToolCallStream`` fed a character at a time: its content and call deltas concatenate to ``result`` of the
    same text at every cut (a body cut there by max_tokens, or finished there)."""
    fmt = make_format(name, None)
    text = ANSWERS[name][which]
    for cut in range(len(text) + 1):
        for finish in ("length", "stop"):
            stream, content, calls = ToolCallStream(fmt), "", {}
            for ch in text[:cut]:
                stream.feed(ch)
                deltas = stream.deltas()
                _apply(deltas, calls)
                content += "".join(d.get("content", "") for d in deltas)
            whole = ToolCallStream(fmt)
            whole.feed(text[:cut])
            want_content, want_calls, _ = whole.result(finish)
            result = stream.result(finish)
            deltas = stream.deltas()
            content += "".join(d.get("content", "") for d in deltas)
            _apply(deltas, calls)
            if result[0] and not stream.calls and result[0] != stream.content:  # raw text, as the server adds it
                content += result[0]
            strip = [{**c, "id": None} for c in want_calls or ()]  # ids are drawn per stream
            assert (result[0], [{**c, "id": None} for c in result[1] or ()]) == (want_content, strip)
            assert content == (want_content or ""), (name, cut, finish)
            assert [(c[0], c[1]) for _, c in sorted(calls.items())] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in want_calls or ()], (name, cut)
    assert result[2] == ("tool_calls" if result[1] else "stop")
    got = (result[0], [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result[1] or ()])
    assert got == READ[name][which]


READ = {  # format -> what ANSWERS' two texts read as: (content, [(name, arguments)])
    "hermes": (("Let me look.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]),
               (None, [("add", {"a": 1, "b": 2})])),
    "llama3_json": ((ANSWERS["llama3_json"][0], []), (None, [("add", {"a": 1, "b": 2})])),
    "mistral": ((ANSWERS["mistral"][0], []), (None, [("add", {"a": 1, "b": 2})])),
    "generic": (('It is "sunny".', []), (None, [("add", {"a": 1, "b": 2})])),
}


def _apply(deltas, calls) -> None:
    for d in deltas:
        for c in d.get("tool_calls", ()):
            call = calls.setdefault(c["index"], ["", ""])
            call[0] += c["function"].get("name") or ""
            call[1] += c["function"]["arguments"]


def test_serve_offers_every_format_by_name():
    from ringshm.cli import build_parser

    a = build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert a.tool_call_parser == "mistral"
    serve = next(p for p in build_parser()._subparsers._group_actions[0].choices.values() if p.prog.endswith("serve"))
    choices = next(x.choices for x in serve._actions if x.dest == "tool_call_parser")
    assert list(choices) == ["auto", *FORMATS]


def _random_tool_request(rng, family: str) -> dict:
    """A random, often malformed, tool request: tools with random parameter schemas and names, a random
    tool_choice, earlier turns with calls and results that may spell special tokens or carry odd ids."""
    from test_server_structured import _random_schema

    special = SPECS[family][2][rng.randrange(len(SPECS[family][2]))]
    names = ["get_weather", "add", "f", "bad name!", "", "x" * 70, f"n{special}"]
    tools = []
    for _ in range(rng.randint(0, 3)):
        fn = {"name": rng.choice(names)}
        if rng.random() < 0.8:
            fn["parameters"] = rng.choice([_random_schema(rng), {"type": "object", "properties": {
                "a": _random_schema(rng)}}, PARAMS["add"], {"type": "string"}])
        if rng.random() < 0.3:
            fn["description"] = rng.choice(["plain", special, 5])
        tools.append(rng.choice([{"type": "function", "function": fn}, {"type": "retrieval"}, fn]))
    body = {"model": "zoo", "max_tokens": 6, "temperature": 0, "messages": list(ASK)}
    if tools or rng.random() < 0.2:
        body["tools"] = tools
    if rng.random() < 0.5:
        body["tool_choice"] = rng.choice(["auto", "required", "none", "sometimes", {"type": "function", "function": {
            "name": rng.choice(names)}}, {"type": "function"}, 3])
    if rng.random() < 0.3:
        body["parallel_tool_calls"] = rng.choice([True, False, "yes"])
    if rng.random() < 0.4:
        call_id = rng.choice(["abcdefghi", "call_1", "", f"id{special}", "123456789"])
        args = rng.choice(['{"a": 1, "b": 2}', "{not json", f'{{"a": "{special}"}}', "[]"])
        body["messages"] += [{"role": "assistant", "tool_calls": [{"id": call_id, "type": "function", "function": {
            "name": "add", "arguments": args}}]}, {"role": "tool", "tool_call_id": call_id, "content": "3"}]
    return body


def test_a_fuzz_of_tool_requests_gets_only_200_or_400_and_the_server_serves_on(srv, client, family):
    """Random and malformed tools, choices and tool turns against each native format's server: never a 500, never
    a hang, and a plain request answers exactly as before after them."""
    import random

    rng = random.Random(31)
    plain = client.chat.completions.create(model="zoo", messages=ASK, max_tokens=8, temperature=0)
    statuses: dict[int, int] = {}
    for _ in range(60):
        body = _random_tool_request(rng, family)
        status, out, _ = srv.post("/v1/chat/completions", body)
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400), (status, body, out)
    assert statuses.get(400, 0) > 10 and statuses.get(200, 0) >= 3, statuses  # both sides reached
    again = client.chat.completions.create(model="zoo", messages=ASK, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == plain.choices[0].message.content
