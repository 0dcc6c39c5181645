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
``function.arguments`` as compact JSON text) with ``content`` null and ``finish_reason`` "tool_calls", or the
reply's ``content`` with "stop". Streamed, the answer is held until its JSON is complete, then sent as OpenAI sends
it: per call, a delta with its index, id, type and name and empty arguments, then a delta with the arguments; so
the concatenated stream equals the non-streamed reply. An answer cut by ``max_tokens`` (incomplete JSON) comes back
as its raw text with "length".

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
        items = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
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
        """``(content, tool_calls, finish_reason)`` of an answer's text: its calls with "tool_calls", its reply
        with the stream's reason, or (cut by max_tokens, or not the format) the raw text as it is."""
        if finish_reason != "stop":
            return text, None, finish_reason
        try:
            doc = json.loads(text)
        except ValueError:
            return text, None, finish_reason
        if isinstance(doc, dict) and isinstance(doc.get("tool_calls"), list):
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False,
                                                                              separators=(",", ":"))}}
                     for c in doc["tool_calls"]]
            return None, calls, "tool_calls"
        if isinstance(doc, dict) and isinstance(doc.get("content"), str):
            return doc["content"], None, finish_reason
        return text, None, finish_reason


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
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON Schema object", "tools")
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
