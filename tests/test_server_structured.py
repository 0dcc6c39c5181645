"""Structured output through the server (issue 30), on the default model in process (``LiveServer`` over a real
2-stage ``Engine``), driven with the official ``openai`` client as agent code drives it: ``.parse`` with a pydantic
model, ``json_object``, vLLM's ``structured_outputs`` extra body (choice / regex / json / grammar), llama.cpp's
``json_schema``; streamed text equal to the non-streamed reply; a schema that cannot be enforced is a 400 naming the
field; and a fuzz of malformed schemas, regexes and grammars gets only 200 / 400, after which the server answers a
plain request exactly."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pydantic
import pytest

from ringshm.engine.engine import Engine
from test_server_abuse import LiveServer


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def srv(model_path):
    server = LiveServer(Engine(model_path, stages=2, max_rows=4, max_seq_len=1024, progress=False),
                        model_names="smollm2", max_waiting=64)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)


def _ask(client, content: str, **kw):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=kw.pop("max_tokens", 48), **kw)


def test_the_openai_sdks_parse_returns_the_pydantic_model(client):
    out = client.chat.completions.parse(model="smollm2", temperature=0, max_tokens=48, response_format=Person,
                                        messages=[{"role": "user", "content": "Invent a person: name and age."}])
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_mode_answers_one_json_object(client):
    out = _ask(client, "Describe a dog as JSON.", response_format={"type": "json_object"}, max_tokens=80)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:
        assert out.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("body, check", [
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-" and (t[:3] + t[4:]).isdigit()),
    ({"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}}, lambda t: isinstance(json.loads(t)["ok"], bool)),
    ({"grammar": 'root ::= "Colour: " ("red" | "green" | "blue")'},
     lambda t: t in ("Colour: red", "Colour: green", "Colour: blue")),
])
def test_vllms_structured_outputs_extra_body_is_honoured(client, body, check):
    """The finding that opened the issue: a choice of yes / no / maybe once came back as free text."""
    out = _ask(client, "Is the sky green? Give a phone number. What colour is grass?",
               extra_body={"structured_outputs": body})
    text = out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop" and check(text), text


def test_llama_cpp_forms_are_enforced_never_dropped(client):
    """``response_format: {"type": "json_object", "schema": ...}`` (llama.cpp's form) holds the answer to the schema;
    ``json_schema: {}`` (any JSON value) still makes the answer JSON."""
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    out = _ask(client, "Name a colour as JSON.", response_format={"type": "json_object", "schema": schema})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    out = _ask(client, "Say hello.", max_tokens=24, extra_body={"json_schema": {}})
    if out.choices[0].finish_reason == "stop":
        json.loads(out.choices[0].message.content)
    else:
        assert out.choices[0].message.content.lstrip()[:1] in '{["-0123456789tfn'


def test_tool_parameters_with_local_refs_resolve_inside_the_tool(client):
    """pydantic's tool schemas hold ``$defs`` and ``#/$defs/...`` refs (and ``#`` for recursion): they resolve
    against the tool's own parameters, not the answer's wrapper schema."""
    city = {"type": "string", "enum": ["PAR", "TYO"]}
    book = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "$defs": {"city": city}, "properties": {"from": {"$ref": "#/$defs/city"},
                                                                 "to": {"$ref": "#/$defs/city"}},
        "required": ["from", "to"], "additionalProperties": False}}}
    out = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=96, tools=[book],
                                         tool_choice="required", parallel_tool_calls=False,
                                         messages=[{"role": "user", "content": "Book Paris to Tokyo."}])
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), book["function"]["parameters"])


def test_llama_cpp_json_schema_field_on_completions(client):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
              "maxItems": 3}
    out = client.completions.create(model="smollm2", prompt="Three digits as a JSON list:", max_tokens=24,
                                    temperature=0, extra_body={"json_schema": schema})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), schema)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": Person.model_json_schema()}},
    {"type": "json_object"},
])
def test_a_streamed_constrained_answer_concatenates_to_the_non_streamed_one(client, fmt):
    kw = dict(response_format=fmt, max_tokens=40)
    whole = _ask(client, "Invent a person as JSON.", **kw)
    parts = [c.choices[0].delta.content or "" for c in _ask(client, "Invent a person as JSON.", stream=True, **kw)
             if c.choices]
    assert "".join(parts) == whole.choices[0].message.content


@pytest.mark.parametrize("fields, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                 "schema": {"not": {"type": "string"}}}}},
     "response_format", "at /not"),
    ({"extra_body": {"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}}, "structured_outputs",
     "uniqueItems"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs", "unclosed group"),
    ({"extra_body": {"grammar": 'root ::= ("a"'}}, "grammar", "does not compile"),
    ({"extra_body": {"json_schema": {"type": "strin"}}}, "json_schema", "not valid"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs", "got none"),
    ({"extra_body": {"grammar": ""}}, "grammar", "non-empty"),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]+"}}, "stop": ["1"]}, "stop", "drop stop"),
    ({"extra_body": {"structured_outputs": {"choice": [f"opt{i}" for i in range(1001)]}}}, "structured_outputs",
     "at most 1000"),
])
def test_a_constraint_that_cannot_be_enforced_is_a_400_naming_the_field(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, "hi", **fields)
    err = info.value.body
    assert err["param"] == param and says in err["message"], err


def _random_schema(rng: random.Random, depth: int = 0):
    """A random, often malformed, JSON Schema-like value."""
    keywords = ["type", "properties", "items", "enum", "const", "minimum", "maximum", "pattern", "format", "anyOf",
                "allOf", "oneOf", "not", "$ref", "required", "minItems", "maxItems", "minLength", "maxLength",
                "additionalProperties", "if", "then", "uniqueItems", "$defs", "multipleOf", "prefixItems"]
    leaves = ["string", "integer", "object", 5, None, True, [], {}, "^[a-z]+$", "(", "date", "#/$defs/x", -1, 1e308,
              "é", ["a", 1], "number", "array", "boolean", "null"]
    if depth > 2 or rng.random() < 0.3:
        return rng.choice(leaves)
    return {rng.choice(keywords): _random_schema(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def test_a_fuzz_of_malformed_constraints_gets_only_200_or_400_and_the_server_serves_on(srv, client):
    rng = random.Random(30)
    plain = _ask(client, "Name a colour.", max_tokens=8).choices[0].message.content
    statuses = {}
    for i in range(240):
        kind = i % 4
        if kind == 0:
            fields = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "f", "schema": _random_schema(rng)}}}
        elif kind == 1:
            fields = {"structured_outputs": {"regex": "".join(rng.choice("ab()[]{}|*+?.\\^$0-9,") for _ in range(
                rng.randint(1, 12)))}}
        elif kind == 2:
            fields = {"structured_outputs": {"grammar": "".join(rng.choice(['root', ' ::= ', '"a"', '|', '(', ')',
                                                                            '*', 'start:', ' x ', '\n', '/b/'])
                                                                for _ in range(rng.randint(1, 10)))}}
        else:
            fields = {"structured_outputs": {"choice": rng.choice([[], [""], ["a"] * 3, ["x", 1], "yes", [None],
                                                                   ["ok", "okay"]])}}
        status, body, _ = srv.post("/v1/chat/completions", {"model": "smollm2", "max_tokens": 2, "temperature": 0,
                                                            "messages": [{"role": "user", "content": "hi"}], **fields})
        statuses[status] = statuses.get(status, 0) + 1
        assert status in (200, 400), (status, fields, body)
    assert statuses.get(400, 0) > 50 and statuses.get(200, 0) > 10, statuses
    assert _ask(client, "Name a colour.", max_tokens=8).choices[0].message.content == plain
    metrics = srv.get("/metrics")[1]
    assert "ringshm_structured_requests_total" in metrics and "ringshm_grammar_compile_seconds_count" in metrics
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("ringshm_grammar_")}
    assert values["ringshm_grammar_masks"] > 0 and values["ringshm_grammar_mask_seconds"] > 0
    assert values["ringshm_grammar_cache_hits"] > 0  # each request: compiled off the loop, then found at its start


# ------------------------------------------------------------------------------------------------ tools
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls(client, messages=ASK_WEATHER, **kw):
    return client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 96), **kw)


@pytest.mark.parametrize("tool_choice, parallel, names", [
    ("required", None, {"get_weather", "add"}),
    ({"type": "function", "function": {"name": "add"}}, None, {"add"}),
    ("required", False, {"get_weather", "add"}),
])
def test_tool_calls_name_an_allowed_tool_with_arguments_that_validate(client, tool_choice, parallel, names):
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    out = _calls(client, tool_choice=tool_choice, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in names and c.id.startswith("call_") for c in calls)
    if parallel is False:
        assert len(calls) == 1
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])


def test_a_streamed_tool_call_concatenates_to_the_non_streamed_one(client):
    """Calls stream as they are generated (id and name first, then argument fragments); the concatenation equals
    the non-streamed reply's calls."""
    whole = _calls(client, tool_choice="required").choices[0].message.tool_calls
    got: dict[int, dict] = {}
    finish, fragments = None, 0
    for chunk in _calls(client, tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or ():
            call = got.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            call["id"] = call["id"] or d.id
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
            fragments += bool(d.function.arguments)
    assert finish == "tool_calls"
    assert fragments > 2 * len(got), "arguments arrive as they are generated, in many fragments"
    assert [(c["name"], c["arguments"]) for _, c in sorted(got.items())] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert all(c["id"] for c in got.values()), "the first delta of each call carries its id"


def test_a_tool_round_trip_call_then_result_then_answer(client):
    first = _calls(client, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}
    messages = ASK_WEATHER + [first.model_dump(exclude_none=True), result]
    out = _calls(client, messages, tool_choice="none", max_tokens=24)
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    auto = _calls(client, messages)  # auto: a call or a reply, either in the format
    msg = auto.choices[0].message
    assert (auto.choices[0].finish_reason == "tool_calls") == bool(msg.tool_calls)
    assert msg.tool_calls or isinstance(msg.content, str)


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": TOOLS, "stop": ["}"]}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {  # its schema over the size limit
        "type": "object", "properties": {"x": {"enum": [f"value-{i:06d}" for i in range(20000)]}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": f"f{j}", "parameters": {  # the answer over it
        "type": "object", "properties": {"x": {"enum": [f"v{i:06d}" for i in range(2500)]}}}}}
        for j in range(12)]}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "add", "arguments": "{not json"}}]}]}, "messages"),
])
def test_malformed_tools_get_a_400_naming_the_field(srv, fields, param):
    body = {"model": "smollm2", "max_tokens": 4, "messages": ASK_WEATHER, **fields}
    status, out, _ = srv.post("/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == param, out


def test_the_tool_call_reader_streams_what_the_body_returns_at_every_cut():
    """``ToolCallStream`` fed a character at a time agrees with ``result`` of the whole text at every
    prefix (a body cut there by max_tokens): names once complete, arguments as the model wrote them, escapes and
    numbers included; a reply's content and text that is not the format come back whole."""
    from ringshm.server.tool_formats import ToolCallStream, make_format

    fmt = make_format("generic", None)

    def parse(text: str, finish: str):
        stream = ToolCallStream(fmt)
        stream.feed(text)
        return stream.result(finish)

    text = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Pa\\"ris\\\\", "n": 12.5e1, "x": [1, '
            '{"y": "}"}]}}, {"name":"add","arguments":{"a":-1,"b":true}}]}')
    for cut in range(len(text) + 1):
        stream, streamed = ToolCallStream(fmt), {}
        for ch in text[:cut]:
            stream.feed(ch)
            for d in stream.deltas():
                for c in d["tool_calls"]:
                    call = streamed.setdefault(c["index"], ["", ""])
                    call[0] += c["function"].get("name") or ""
                    call[1] += c["function"]["arguments"]
        finish = "stop" if cut == len(text) else "length"
        content, calls, reason = parse(text[:cut], finish)
        if calls is not None:
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
                tuple(streamed[i]) for i in sorted(streamed)], cut
        else:
            assert not streamed and content is None, cut  # cut before a name: no call, and none of the wrapper
    assert reason == "tool_calls" and json.loads(calls[0]["function"]["arguments"])["x"][1] == {"y": "}"}
    assert parse('{"content": "caf\\u00e9 \\"ok\\""}', "stop") == ('café "ok"', None, "stop")
    assert parse('{"answer": 1}', "stop") == ('{"answer": 1}', None, "stop")
    assert parse('{"content": "half a rep', "length") == (None, None, "length")
