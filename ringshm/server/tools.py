"""Tool calls on ``/v1/chat/completions`` (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``), in the
model's own format where its chat template has one, else a generic format every model can follow; either way
enforced by a structured output (``ringshm.engine.grammar``). The formats, their grammars and their readers:
``ringshm.server.tool_formats``.

The generic format: the tools are described in the system turn (after the request's own system text), and the
answer is one JSON object, constrained by a JSON schema built from the tools' ``parameters``:

    {"tool_calls": [{"name": "<a tool's name>", "arguments": {...its parameters...}}, ...]}   a call (or several)
    {"content": "<text>"}                                                                        a reply

A native format (``hermes``, ``llama3_json``, ``mistral``): the tools go to the chat template
(``apply_chat_template(tools=...)``), earlier calls and results are rendered by it, and the answer is held to the
format's grammar (``auto``: text, then a call once its marker is written).

``tool_choice``: ``"none"`` (the default without tools) answers as a plain chat, tools left out of the prompt;
``"auto"`` (the default with tools) lets the model pick a call or a reply; ``"required"`` allows only calls;
``{"type": "function", "function": {"name": ...}}`` only calls of that tool. ``parallel_tool_calls: false`` allows
one call (``llama3_json`` always writes one). The arguments are always enforced by their schema (``strict`` or not:
a keyword that cannot be enforced is a 400 naming ``tools`` and its JSON pointer, never dropped).

The reply: ``message.tool_calls`` (``id`` "call_<24 hex>", 9 letters and digits for ``mistral``; ``type``
"function", ``function.name``, ``function.arguments``: the JSON text of the arguments as the model wrote it) with
the text before them as ``content`` (null when none) and ``finish_reason`` "tool_calls", or the reply's ``content``
with "stop". Streamed as OpenAI streams calls, as they are generated (``ToolCallStream``): per call, a delta with
its index, id, type and name (empty arguments) once the name is complete, then the arguments' text as it grows.
Both read the text the same way, so the concatenated stream equals the non-streamed reply. An answer cut by
``max_tokens`` keeps its calls so far (the last one's arguments cut short, as OpenAI returns them) with "length"; a
generic answer cut before its first key or inside a reply comes back with no content (the format's own text never
reaches the client).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ringshm.generation_params import StructuredOutput
from ringshm.server.openai_schema import bad_request
from ringshm.server.tool_formats import ToolCallStream, ToolFormat

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name


@dataclass
class ToolPlan:
    """What one request's tools make of its prompt, its constraint and its answer (module docstring)."""

    tools: list[dict]  # [{"name", "description", "parameters"}]
    allowed: list[str]  # names the answer may call
    required: bool  # a call is the only answer
    parallel: bool
    fmt: ToolFormat

    # ------------------------------------------------------------------------------------------- prompt
    def system_text(self) -> str:
        """The tools and the answer format, for the system turn (the generic format)."""
        listing = json.dumps([{"name": t["name"], "description": t.get("description", ""),
                               "parameters": t["parameters"]} for t in self.tools], ensure_ascii=False)
        calls = ('{"tool_calls": [{"name": "<tool name>", "arguments": {<its parameters>}}]}'
                 + (" (several calls in one list if needed)" if self.parallel else " (one call)"))
        answer = (f"Answer with one JSON object: {calls}" if self.required else
                  f"Answer with one JSON object: {calls} to call a tool, or {{\"content\": \"<your reply>\"}} to "
                  f"reply to the user")
        return f"You can call these tools: {listing}\n{answer}."

    def messages(self, messages: list[dict]) -> list[dict]:
        """``messages`` (``plain_messages``') as the template gets them: for the generic format, with the tools in
        the system turn (the request's first system message extended, or a new one first); a native format's
        template gets the tools itself (``template_tools``)."""
        if self.fmt.native:
            return messages
        out = list(messages)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{self.system_text()}"}
        else:
            out.insert(0, {"role": "system", "content": self.system_text()})
        return out

    def template_tools(self) -> list[dict] | None:
        """The tools for a native format's chat template (OpenAI's ``{"type": "function", "function": ...}``
        entries, as transformers' ``apply_chat_template(tools=...)`` takes them); None for the generic format."""
        if not self.fmt.native:
            return None
        return [{"type": "function", "function": t} for t in self.tools]

    # --------------------------------------------------------------------------------------- constraint
    def checks(self) -> list[tuple[str, StructuredOutput]]:
        """Each tool's ``parameters`` as a JSON-schema structured output, with where it was given: compiled before
        the answer's grammar, so that a keyword the engine cannot enforce is named with its tool and JSON pointer."""
        return [(f"tools[{i}].function.parameters", StructuredOutput("json_schema", t["parameters"]))
                for i, t in enumerate(self.tools)]

    def constraint(self) -> StructuredOutput:
        """The grammar the answer is held to (``ToolFormat.constraint``)."""
        return self.fmt.constraint(self.tools, self.allowed, self.required, self.parallel)

    # ------------------------------------------------------------------------------------------- answer
    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """``(content, tool_calls, finish_reason)`` of a finished answer's text (``ToolCallStream.result``, so a
        stream and a body agree byte for byte)."""
        stream = ToolCallStream(self.fmt)
        stream.feed(text)
        return stream.result(finish_reason)


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


def tool_plan(tools, tool_choice, parallel_tool_calls, fmt: ToolFormat) -> ToolPlan | None:
    """The ``ToolPlan`` of a chat request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` in the server's
    tool-call format ``fmt``, or None when it calls no tool (no tools, or ``tool_choice`` "none").

    Raises:
        ApiError 400: malformed tools (named by index), a duplicate name, a ``tool_choice`` that is not "none" /
            "auto" / "required" / a named function among the tools, a choice without tools, or (a native format,
            whose template writes the tools outside the placeholders its contents are tokenised from) a tool whose
            text spells one of the tokenizer's special tokens.
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
    for i, f in enumerate(fns):
        spelled = fmt.spells_special(json.dumps(f, ensure_ascii=False))
        if spelled:
            raise bad_request(f"tools[{i}] spells the special token {spelled!r}, which the chat template would "
                              f"read as the token itself: remove it", "tools")
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
        return ToolPlan(fns, [name], True, parallel, fmt)
    return ToolPlan(fns, names, tool_choice == "required", parallel, fmt)
