"""The tool-call formats an answer can be written in, each with the grammar that holds an answer to it and the
reader that turns its text into OpenAI's ``content`` / ``tool_calls`` (whole, or as stream deltas).

- ``generic``, for a template without tool support (SmolLM2): a call is ``{"tool_calls": [{"name", "arguments"},
  ...]}``, a reply ``{"content": "..."}``; one JSON object, so no text before a call.
- ``hermes``, for a template that writes ``<tool_call>`` (Qwen 2.5 / 3, Hermes): each call a block
  ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>``; ``auto`` allows text before the first.
- ``llama3_json``, for a Llama 3.1+ template (JSON calls with ``"parameters"``): the whole answer is one call
  ``{"name", "parameters"}``, or text.
- ``mistral``, for a template that writes ``[TOOL_CALLS]``: ``[TOOL_CALLS][{"name", "arguments"}, ...]``, or text.

The format comes from the model's chat template (``detect_format``: the strings its tool branch writes), or from
``serve --tool-call-parser`` (vLLM's names). Native formats (all but ``generic``) put the tools in the prompt through
the template itself (``apply_chat_template(tools=...)``) and render earlier calls and results as the template does;
the generic one describes the tools in the system turn (``ringshm.server.tools``).

How ``auto`` holds an answer: the text is free until the call's marker is written, then the call is held to its
schema (llguidance's lazy lexeme: the first ``<tool_call>`` ends the text); ``llama3_json`` text may not start with
``{``, ``mistral`` text may not start with ``[TOOL_CALLS]``, so a call is never mistaken for text or the reverse.
``required`` and a named function allow calls only. A marker the grammar engine holds as a token (llguidance: an
added token marked special or spelled ``<...>``, e.g. Qwen's ``<tool_call>``) is written as that token (``<[id]>``
in the grammar), and text may not spell it where the reader would take it for one; one that decoding drops (marked
special: Mistral's ``[TOOL_CALLS]``) is put back into the text the reader sees.

The reader (``ToolCallStream``) re-reads the whole text at each delta, so what it reports only grows, and a
non-streamed answer is read by the same code: the concatenated stream equals the body byte for byte. Text before a
call is streamed as ``content`` as it comes, except what may still become a marker and trailing whitespace (a
reply's text is left as written; text before a call loses its trailing whitespace, and is null when nothing is
left).
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass, field

from ringshm.engine.grammar import MAX_JSON_WHITESPACE
from ringshm.generation_params import StructuredOutput
from ringshm.model.tokenizer import special_spellings

FORMATS = ("generic", "hermes", "llama3_json", "mistral")
MAX_PARALLEL_CALLS = 8  # calls in one answer when parallel_tool_calls is true
_X_GUIDANCE = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{1,{MAX_JSON_WHITESPACE}}}"}  # as every JSON answer


def detect_format(chat_template: str | None) -> str:
    """The tool-call format a chat template writes (``FORMATS``): ``hermes`` when it writes ``<tool_call>``,
    ``mistral`` when it writes ``[TOOL_CALLS]``, ``llama3_json`` for a Llama 3 header template that describes
    calls with ``"parameters"``, else ``generic``."""
    t = chat_template or ""
    if "tools" not in t:
        return "generic"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|start_header_id|>" in t and "parameters" in t:
        return "llama3_json"
    return "generic"


@dataclass
class ToolFormat:
    """One format (module docstring) on one tokenizer: its markers, written as tokens where the grammar engine
    holds them as special tokens (``special``: llguidance takes every added token that is marked special or reads
    ``<...>`` as one, e.g. Qwen's ``<tool_call>``), and put back into the text where decoding drops them
    (``marker_ids``: the ones marked special)."""

    name: str
    special: dict = field(default_factory=dict)  # marker text -> token id, markers the grammar writes as tokens
    marker_ids: dict = field(default_factory=dict)  # token id -> marker text, markers that decoding drops
    specials: tuple = ()  # the tokenizer's special tokens' spellings, longest first (``special_spellings``)

    def spells_special(self, text: str) -> str | None:
        """The first special token of the tokenizer that ``text`` spells, for a native format (its template writes
        tools and call arguments outside the placeholders contents are tokenised from, so such a spelling would
        become the token); None when none does or the format is generic."""
        if not self.native:
            return None
        return next((t for t in self.specials if t in text), None)

    @property
    def native(self) -> bool:
        """Whether the chat template renders the tools and earlier calls (every format but ``generic``)."""
        return self.name != "generic"

    def new_id(self) -> str:
        """A call id: "call_<24 hex>" (OpenAI's shape); 9 letters and digits for ``mistral`` (its templates
        refuse other ids in later turns)."""
        if self.name == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{uuid.uuid4().hex[:24]}"

    # --------------------------------------------------------------------------------------------- grammar
    def _mark(self, text: str) -> str:
        """``text`` in the grammar: its special token (by id: ``<[id]>``), or a string."""
        return f"<[{self.special[text]}]>" if text in self.special else json.dumps(text)

    def constraint(self, tools: list[dict], allowed: list[str], required: bool, parallel: bool) -> StructuredOutput:
        """The grammar an answer is held to: calls of ``allowed`` tools (each ``{"name", "description",
        "parameters"}``) with their arguments' schemas, and, unless ``required``, a reply instead (``auto``);
        several calls when ``parallel`` (``llama3_json``: one)."""
        args = "parameters" if self.name == "llama3_json" else "arguments"
        # each tool's parameters its own schema resource ($id): its "#/$defs/..." and "#" refs resolve inside it
        items = [{"type": "object", "properties": {"name": {"const": t["name"]}, args: {
            "$id": f"urn:ringshm:tool:{t['name']}", **t["parameters"]} if "$id" not in t["parameters"] else
            t["parameters"]}, "required": ["name", args], "additionalProperties": False}
            for t in tools if t["name"] in allowed]
        one = items[0] if len(items) == 1 else {"anyOf": items}
        n_max = MAX_PARALLEL_CALLS if parallel else 1
        if self.name == "generic":
            calls = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": one, "minItems": 1,
                                                                      "maxItems": n_max}},
                     "required": ["tool_calls"], "additionalProperties": False}
            reply = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"],
                     "additionalProperties": False}
            # a grammar, not a json_schema: each tool's parameters were checked against the meta-schema alone
            # (``ToolPlan.checks``), and checking this wrapper again took ~8 ms of a ~11 ms compile
            answer = {"x-guidance": _X_GUIDANCE, **(calls if required else {"anyOf": [calls, reply]})}
            return StructuredOutput("grammar", f"%llguidance {{}}\nstart: %json {json.dumps(answer)}\n")
        head = "%llguidance {}\n"
        if self.name == "hermes":
            start, end = self._mark("<tool_call>"), self._mark("</tool_call>")
            body = f'"\\n" %json {json.dumps({"x-guidance": _X_GUIDANCE, **one})} "\\n" {end}'
            more = f'("\\n" {start} body)~0..{n_max - 1}' if n_max > 1 else ""
            if required:
                rules = f"start: {start} body {more}\n"
            elif "<tool_call>" in self.special:  # text ends where the token comes, and never spells it
                rules = (f"start: TEXT | TEXT {start} body {more}\n"
                         f"TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/\n")
            else:
                rules = f"start: TEXT | head body {more}\nTEXT: /(?s:.*)/\nhead[lazy]: TEXT {start}\n"
            return StructuredOutput("grammar", f"{head}{rules}body: {body}\n")
        if self.name == "llama3_json":
            call = f"%json {json.dumps({'x-guidance': _X_GUIDANCE, **one})}"
            if required:
                return StructuredOutput("grammar", f"{head}start: {call}\n")
            return StructuredOutput("grammar", f"{head}start: TEXT | {call}\n"
                                               f"TEXT: /(?s:.*)/ & ~/[ \\t\\r\\n]*\\{{(?s:.*)/\n")
        many = {"x-guidance": _X_GUIDANCE, "type": "array", "items": one, "minItems": 1, "maxItems": n_max}
        calls = f"{self._mark('[TOOL_CALLS]')} %json {json.dumps(many)}"
        if required:
            return StructuredOutput("grammar", f"{head}start: {calls}\n")
        return StructuredOutput("grammar", f"{head}start: TEXT | {calls}\n"
                                           f"TEXT: /(?s:.*)/ & ~/\\[TOOL_CALLS\\](?s:.*)/\n")

    # ---------------------------------------------------------------------------------------------- reading
    def read(self, s: ToolCallStream, t: str, final: bool) -> None:
        """Read text ``t`` into ``s`` (``kind``, ``content``, ``calls``); raises ``_Incomplete`` where ``t`` ends
        inside what is being read. ``final``: ``t`` is the whole answer."""
        if self.name == "generic":
            return _read_generic(s, t)
        if self.name == "hermes":
            return _read_hermes(s, t, final)
        if self.name == "llama3_json":
            i = _ws(t, 0)
            if i < len(t) and t[i] == "{":
                s.kind = "calls"
                _call_object(s, t, i, "parameters")
            elif i < len(t) or final:
                s.kind, s.content = "content", t
            return None
        mark = "[TOOL_CALLS]"
        if t.startswith(mark):
            s.kind = "calls"
            _call_list(s, t, _ws(t, len(mark)), "arguments")
        elif final or not mark.startswith(t):
            s.kind, s.content = "content", t
        return None


def make_format(name: str, tokenizer) -> ToolFormat:
    """``name``'s ``ToolFormat`` on ``tokenizer`` (a transformers tokenizer, or None: no markers are tokens):
    which of its markers are tokens to the grammar engine, which ones decoding drops.

    Raises:
        ValueError: ``name`` is not one of ``FORMATS``.
    """
    if name not in FORMATS:
        raise ValueError(f"the tool-call format must be one of {', '.join(FORMATS)}, got {name!r}")
    markers = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]",)}.get(name, ())
    added = tokenizer.added_tokens_decoder if tokenizer is not None else {}
    as_tokens = {t.content: i for i, t in added.items()
                 if t.special or (t.content[:1] == "<" and t.content[-1:] == ">")}
    hidden = special_spellings(tokenizer) if tokenizer is not None else []
    special = {m: as_tokens[m] for m in markers if m in as_tokens}
    return ToolFormat(name, special, {i: m for m, i in special.items() if m in hidden}, tuple(hidden))


class _Incomplete(Exception):
    """The text ends inside what is being read."""


@dataclass
class _Call:
    name: str | None = None  # None until its string is complete
    arguments: str = ""  # the raw JSON text of its arguments so far (the model's own bytes)


class ToolCallStream:
    """Reads an answer in ``fmt`` as its text grows (``feed``): which kind it is ("calls" or "content", None while
    undecided), its content so far (as safe to show: module docstring), each call's name once complete and its
    arguments' raw text so far. Each ``feed`` re-reads the whole text (answers are short), so what it reports only
    grows; ``deltas`` gives OpenAI's stream deltas for what is new, ``result`` the finished message."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.text = ""
        self.kind: str | None = None
        self.calls: list[_Call] = []
        self.content: str | None = None
        self.ids: list[str] = []  # one per call, made when its name is first reported
        self._sent: list[int] = []  # per call whose name was sent: argument characters sent
        self._sent_content = 0

    def feed(self, delta: str, final: bool = False) -> None:
        """Add ``delta`` (the answer's next text; ``final``: the answer ends there) and re-read the whole answer;
        never raises (text that is not the format leaves ``kind`` None)."""
        self.text += delta
        self.calls, self.content, self.kind = [], None, None
        try:
            self.fmt.read(self, self.text, final)
        except _Incomplete:
            pass
        while len(self.ids) < sum(c.name is not None for c in self.calls):
            self.ids.append(self.fmt.new_id())

    def deltas(self) -> list[dict]:
        """OpenAI's ``delta`` objects for what ``feed`` found since the last call: content as it grows, then per
        call one with its index, id, type and name (and empty arguments) once the name is complete, then its
        arguments as they grow."""
        out = []
        if self.content and len(self.content) > self._sent_content:
            out.append({"content": self.content[self._sent_content:]})
            self._sent_content = len(self.content)
        for i, call in enumerate(self.calls):
            if call.name is None:
                break
            if i == len(self._sent):
                self._sent.append(0)
                out.append({"tool_calls": [{"index": i, "id": self.ids[i], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            if len(call.arguments) > self._sent[i]:
                out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments[self._sent[i]:]}}]})
                self._sent[i] = len(call.arguments)
        return out

    def result(self, finish_reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """``(content, tool_calls, finish_reason)`` of the answer fed so far, read as finished: its calls
        ("tool_calls", or the stream's reason when cut by max_tokens: the calls so far, the last one's arguments
        cut short, as OpenAI returns them) with the text before them, or its reply's content."""
        self.feed("", final=True)
        calls = [{"id": self.ids[i], "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(self.calls) if c.name is not None]
        if self.kind == "calls":
            return self.content, calls, "tool_calls" if finish_reason == "stop" else finish_reason
        if self.kind == "content" and self.content is not None:
            return self.content, None, finish_reason
        if finish_reason != "stop":  # generic, cut before its first key or inside a reply: no wrapper goes out
            return None, None, finish_reason
        return self.text, None, finish_reason


# ------------------------------------------------------------------------------------------- format readers
def _read_generic(s: ToolCallStream, t: str) -> None:
    i = _expect(t, _ws(t, 0), "{")
    key, i = _string(t, _ws(t, i))
    i = _expect(t, _ws(t, i), ":")
    if key == "content":
        j = _ws(t, i)
        end = _skip(t, j)
        s.kind, s.content = "content", json.loads(t[j:end])
        return
    if key != "tool_calls":
        raise _Incomplete  # not the format: the raw text stands
    s.kind = "calls"
    _call_list(s, t, _ws(t, i), "arguments")


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def _read_hermes(s: ToolCallStream, t: str, final: bool) -> None:
    m = t.find(_HERMES_OPEN)
    if m < 0:
        s.kind = "content"
        if final:
            s.content = t
            return
        hold = next((k for k in range(min(len(t), len(_HERMES_OPEN) - 1), 0, -1)
                     if _HERMES_OPEN.startswith(t[-k:])), 0)  # what may still become the marker
        s.content = t[:len(t) - hold].rstrip()
        return
    s.kind, s.content = "calls", t[:m].rstrip() or None
    i = m + len(_HERMES_OPEN)
    while True:
        i = _call_object(s, t, _ws(t, i), "arguments")
        i = _ws(t, i)
        if not t.startswith(_HERMES_CLOSE, i):
            raise _Incomplete
        i = _ws(t, i + len(_HERMES_CLOSE))
        if not t.startswith(_HERMES_OPEN, i):
            raise _Incomplete
        i += len(_HERMES_OPEN)


def _call_list(s: ToolCallStream, t: str, i: int, args_key: str) -> None:
    """A JSON list of call objects at ``t[i]``."""
    i = _expect(t, i, "[")
    while True:
        i = _ws(t, i)
        if i < len(t) and t[i] == "]":
            return
        i = _ws(t, _call_object(s, t, i, args_key))
        if i >= len(t):
            raise _Incomplete
        if t[i] == ",":
            i += 1


def _call_object(s: ToolCallStream, t: str, i: int, args_key: str) -> int:
    """One call object ``{"name": ..., <args_key>: {...}}`` at ``t[i]``, appended to ``s.calls`` (its arguments'
    text so far when ``t`` ends inside them). Returns the index past its ``}``."""
    i = _expect(t, i, "{")
    call = _Call()
    s.calls.append(call)
    while True:
        k, i = _string(t, _ws(t, i))
        i = _ws(t, _expect(t, _ws(t, i), ":"))
        if k == "name":
            call.name, i = _string(t, i)
        elif k == args_key:
            try:
                end = _skip(t, i)
            except _Incomplete:
                call.arguments = t[i:]
                raise
            call.arguments, i = t[i:end], end
        else:
            i = _skip(t, i)
        i = _ws(t, i)
        if i >= len(t):
            raise _Incomplete
        if t[i] == "}":
            return i + 1
        i = _expect(t, i, ",")


_WS = re.compile(r"[ \t\r\n]*")


def _ws(t: str, i: int) -> int:
    return _WS.match(t, i).end()


def _expect(t: str, i: int, ch: str) -> int:
    if i >= len(t) or t[i] != ch:
        raise _Incomplete
    return i + 1


def _string(t: str, i: int) -> tuple[str, int]:
    end = _skip(t, _expect(t, i, '"') - 1)
    return json.loads(t[i:end]), end


def _skip(t: str, i: int) -> int:
    """The end of the JSON value starting at ``t[i]``; raises _Incomplete when the text ends inside it."""
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
