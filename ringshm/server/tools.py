"""Tool calls on ``/v1/chat/completions`` (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``), in the
generic format every model can follow, enforced by a structured output (``ringshm.engine.grammar``).

The generic format: the tools are described in the system turn (after the request's own system text), and the
answer is one JSON object, constrained by a JSON schema built from the tools' ``parameters``:

    {"tool_calls": [{"name": "<a tool's name>", "arguments": {...its parameters...}}, ...]}   a call (or several)
    {"content": "<text>"}                                                                        a reply

``tool_choice``: ``"none"`` (the default without tools) answers as a plain chat, tools left out of the prompt;
``"auto"`` (the default with tools) lets the model pick a call or a reply; ``"required"`` allows only calls;
``{"type": "function", "function": {"name": ...}}`` only calls of that tool. ``parallel_tool_calls: false`` allows
one call. The arguments are always enforced by their schema (``strict`` or not: a keyword that cannot be enforced is
a 400 naming ``tools`` and its JSON pointer, never dropped).

Earlier turns: an assistant message's ``tool_calls`` are rendered as the JSON it would have written, a ``tool``
message as a user turn holding the result, so any chat template takes them
(``ringshm.server.openai_schema.plain_messages``).

The reply: ``message.tool_calls`` (``id`` "call_<24 hex>", ``type`` "function", ``function.name``,
``function.arguments``: the JSON text of the arguments as the model wrote it) with ``content`` null and
``finish_reason`` "tool_calls", or the reply's ``content`` with "stop". Streamed as OpenAI streams calls, as they
are generated (``ToolCallStream``): per call, a delta with its index, id, type and name (empty arguments) once the
name is complete, then the arguments' text as it grows; a reply's content once its string is complete. Both read
the text the same way, so the concatenated stream equals the non-streamed reply. An answer cut by ``max_tokens``
keeps its calls so far (the last one's arguments cut short, as OpenAI returns them) with "length"; cut before its
first key or inside a reply, it comes back with no content (the format's own text never reaches the client).

Not built yet: a model's own tool-call format from its chat template (Qwen's ``<tool_call>``, Llama 3.1's JSON,
Mistral's ``[TOOL_CALLS]``): every model gets the generic format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ringshm.generation_params import StructuredOutput
from ringshm.server.openai_schema import bad_request

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # calls in one answer when parallel_tool_calls is true
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name


@dataclass
class ToolPlan:
    """What one request's tools make of its prompt, its constraint and its answer (module docstring)."""

    tools: list[dict]  # [{"name", "description", "parameters"}]
    allowed: list[str]  # names the answer may call
    required: bool  # a call is the only answer
    parallel: bool

    # ------------------------------------------------------------------------------------------- prompt
    def system_text(self) -> str:
        """The tools and the answer format, for the system turn."""
        listing = json.dumps([{"name": t["name"], "description": t.get("description", ""),
                               "parameters": t["parameters"]} for t in self.tools], ensure_ascii=False)
        calls = ('{"tool_calls": [{"name": "<tool name>", "arguments": {<its parameters>}}]}'
                 + (" (several calls in one list if needed)" if self.parallel else " (one call)"))
        answer = (f"Answer with one JSON object: {calls}" if self.required else
                  f"Answer with one JSON object: {calls} to call a tool, or {{\"content\": \"<your reply>\"}} to "
                  f"reply to the user")
        return f"You can call these tools: {listing}\n{answer}."

    def messages(self, messages: list[dict]) -> list[dict]:
        """``messages`` (``plain_messages``', tool turns already text) with the tools in the system turn: the
        request's first system message extended, or a new one first."""
        out = list(messages)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{self.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": self.system_text()})
        return out

    # --------------------------------------------------------------------------------------- constraint
    def constraint(self) -> StructuredOutput:
        """The JSON schema the answer is held to."""
        # each tool's parameters its own schema resource ($id): its "#/$defs/..." and "#" refs resolve inside it,
        # not against this wrapper (what pydantic's schemas hold)
        items = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": {
            "$id": f"urn:ringshm:tool:{t['name']}", **t["parameters"]} if "$id" not in t["parameters"] else
            t["parameters"]}, "required": ["name", "arguments"], "additionalProperties": False}
            for t in self.tools if t["name"] in self.allowed]
        calls = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}}, "required": ["tool_calls"],
            "additionalProperties": False}
        reply = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                 "additionalProperties": False}
        return StructuredOutput("json_schema", calls if self.required else {"anyOf": [calls, reply]})

    # ------------------------------------------------------------------------------------------- answer
    @staticmethod
    def parse(text: str, finish_reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """``(content, tool_calls, finish_reason)`` of a finished answer's text (``ToolCallStream``'s reading, so
        a stream and a body agree byte for byte): its calls ("tool_calls", or the stream's reason when cut by
        max_tokens: the calls so far, the last one's arguments cut short, as OpenAI returns them), its reply's
        content, or the raw text when it is not the format."""
        stream = ToolCallStream()
        stream.feed(text)
        calls = [{"id": stream.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(stream.calls) if c.name is not None]
        if stream.kind == "calls":
            return None, calls, "tool_calls" if finish_reason == "stop" else finish_reason
        if stream.kind == "content" and stream.content is not None:
            return stream.content, None, finish_reason
        if finish_reason != "stop":  # cut before its first key or inside a reply: none of the wrapper goes out
            return None, None, finish_reason
        return text, None, finish_reason


class _Incomplete(Exception):
    """The text ends inside what is being read."""


@dataclass
class _Call:
    name: str | None = None  # None until its string is complete
    arguments: str = ""  # the raw JSON text of its arguments so far (the model's own bytes)


class ToolCallStream:
    """Reads an answer in the generic format as its text grows (``feed``): which kind it is ("calls" or
    "content", None until its first key is complete), each call's name once complete and its arguments' raw text
    so far, the reply's content once complete. Each ``feed`` re-reads the whole text (answers are short), so what
    it reports only grows; ``deltas`` gives OpenAI's stream deltas for what is new."""

    def __init__(self):
        self.text = ""
        self.kind: str | None = None
        self.calls: list[_Call] = []
        self.content: str | None = None
        self.ids: list[str] = []  # one per call, made when its name is first reported
        self._sent: list[tuple[bool, int]] = []  # per call: name sent, argument characters sent

    def feed(self, delta: str) -> None:
        """Add ``delta`` (the answer's next text) and re-read the whole answer; never raises (text that is not the
        format leaves ``kind`` None)."""
        self.text += delta
        self.calls, self.content = [], None
        try:
            self._read()
        except _Incomplete:
            pass
        while len(self.ids) < sum(c.name is not None for c in self.calls):
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")

    def deltas(self) -> list[dict]:
        """OpenAI's ``delta`` objects for what ``feed`` found since the last call: per call, one with its index,
        id, type and name (and empty arguments) once the name is complete, then its arguments as they grow."""
        out = []
        for i, call in enumerate(self.calls):
            if call.name is None:
                break
            if i == len(self._sent):
                self._sent.append((True, 0))
                out.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            sent = self._sent[i][1]
            if len(call.arguments) > sent:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[sent:]}}]})
                self._sent[i] = (True, len(call.arguments))
        return out

    # ----------------------------------------------------------------------------------------- reading
    def _read(self) -> None:
        t = self.text
        i = self._expect(t, self._ws(t, 0), "{")
        key, i = self._string(t, self._ws(t, i))
        i = self._expect(t, self._ws(t, i), ":")
        if key == "content":
            j = self._ws(t, i)
            end = self._skip(t, j)
            self.kind, self.content = "content", json.loads(t[j:end])
            return
        if key != "tool_calls":
            raise _Incomplete  # not the format: the raw text stands
        self.kind = "calls"
        i = self._expect(t, self._ws(t, i), "[")
        while True:
            i = self._ws(t, i)
            if i < len(t) and t[i] == "]":
                return
            i = self._expect(t, i, "{")
            call = _Call()
            self.calls.append(call)
            while True:
                k, i = self._string(t, self._ws(t, i))
                i = self._ws(t, self._expect(t, self._ws(t, i), ":"))
                if k == "name":
                    call.name, i = self._string(t, i)
                elif k == "arguments":
                    try:
                        end = self._skip(t, i)
                    except _Incomplete:
                        call.arguments = t[i:]
                        raise
                    call.arguments, i = t[i:end], end
                else:
                    i = self._skip(t, i)
                i = self._ws(t, i)
                if i >= len(t):
                    raise _Incomplete
                if t[i] == "}":
                    i += 1
                    break
                i = self._expect(t, i, ",")
            i = self._ws(t, i)
            if i >= len(t):
                raise _Incomplete
            if t[i] == ",":
                i += 1

    @staticmethod
    def _ws(t: str, i: int) -> int:
        while i < len(t) and t[i] in " \t\r\n":
            i += 1
        return i

    @staticmethod
    def _expect(t: str, i: int, ch: str) -> int:
        if i >= len(t) or t[i] != ch:
            raise _Incomplete
        return i + 1

    def _string(self, t: str, i: int) -> tuple[str, int]:
        end = self._skip(t, self._expect(t, i, '"') - 1)
        return json.loads(t[i:end]), end

    @staticmethod
    def _skip(t: str, i: int) -> int:
        """The end of the JSON value starting at ``i``; raises _Incomplete when the text ends inside it."""
        if i >= len(t):
            raise _Incomplete
        if t[i] == '"':
            j = i + 1
            while j < len(t):
                if t[j] == "\\":
                    j += 2
                    continue
                if t[j] == '"':
                    return j + 1
                j += 1
            raise _Incomplete
        if t[i] in "{[":
            depth, j, in_str = 0, i, False
            while j < len(t):
                c = t[j]
                if in_str:
                    if c == "\\":
                        j += 1
                    elif c == '"':
                        in_str = False
                elif c == '"':
                    in_str = True
                elif c in "{[":
                    depth += 1
                elif c in "}]":
                    depth -= 1
                    if depth == 0:
                        return j + 1
                j += 1
            raise _Incomplete
        j = i
        while j < len(t) and t[j] not in ",}] \t\r\n":
            j += 1
        if j >= len(t):
            raise _Incomplete  # a number or literal may go on
        return j


def _function(i: int, tool) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": '
                          f'{{...}}}}}} (only function tools are supported)', "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {str(name)[:70]!r}",
                          "tools")
    params = fn.get("parameters", {"type": "object", "properties": {}, "additionalProperties": False})  # none
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise bad_request(f'{where}.function.parameters must be a JSON Schema of an object ({{"type": "object", '
                          f'"properties": ...}}): arguments are a JSON object', "tools")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", "tools")
    if fn.get("strict") not in (None, True, False):
        raise bad_request(f"{where}.function.strict must be a boolean", "tools")
    return {"name": name, "description": description, "parameters": params}


def tool_plan(tools, tool_choice, parallel_tool_calls) -> ToolPlan | None:
    """The ``ToolPlan`` of a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``, or None when it
    calls no tool (no tools, or ``tool_choice`` "none").

    Raises:
        ApiError 400: malformed tools (named by index), a duplicate name, a ``tool_choice`` that is not "none" /
            "auto" / "required" / a named function among the tools, or a choice without tools.
    """
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, str) and tool_choice not in ("none", "auto", "required"):
        raise bad_request(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                          f'{{"name": ...}}}}, got {tool_choice[:40]!r}', "tool_choice")
    if tool_choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    fns = [_function(i, t) for i, t in enumerate(tools)]
    names = [f["name"] for f in fns]
    if len(set(names)) != len(names):
        raise bad_request("tools name a function twice: give each function once", "tools")
    if parallel_tool_calls not in (None, True, False):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(f'tool_choice must name one of the tools ({", ".join(names[:8])}) as {{"type": '
                              f'"function", "function": {{"name": ...}}}}', "tool_choice")
        return ToolPlan(fns, [name], True, parallel)
    return ToolPlan(fns, names, tool_choice == "required", parallel)
