"""Structured output on the wire: the request fields that constrain the answer, read into one
``StructuredOutput`` (``ringshm.generation_params``) or refused with a 400 naming the field.

Read, on ``/v1/chat/completions`` and ``/v1/completions`` alike:

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (with llama.cpp's
  ``"schema"`` beside it: that schema), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}``. ``strict`` true or false, the schema is enforced whole (the grammar engine fails closed: a
  keyword it cannot enforce is a 400, never dropped), so ``strict: true`` is never weakened;
- vLLM's extra body ``structured_outputs``: exactly one (none is a 400, as in vLLM) of ``json`` (a schema, or its
  JSON text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark, or GBNF recognised by ``::=``),
  ``json_object`` (true); ``disable_fallback`` is accepted (ringshm never falls back to another engine); the other
  vLLM options (``whitespace_pattern``, ``disable_any_whitespace``, ``disable_additional_properties``,
  ``structural_tag``) are refused by name;
- llama.cpp server's ``json_schema`` (a schema; ``{}`` is any JSON value) and ``grammar`` (GBNF) body fields.

At most one of these per request. vLLM's removed ``guided_*`` fields stay refused, pointing to
``structured_outputs``.
"""

from __future__ import annotations

from ringshm.generation_params import StructuredOutput
from ringshm.server.openai_schema import bad_request

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
               "json_object": "json_object"}
_VLLM_ACCEPTED = {"disable_fallback"}  # any value: there is no fallback engine to disable


def _spec(kind: str, value, param: str) -> StructuredOutput:
    try:
        return StructuredOutput(kind, value)
    except ValueError as exc:
        raise bad_request(str(exc), param) from None


def _response_format(value) -> StructuredOutput | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request('response_format must be an object with a "type": "text", "json_object" or '
                          '"json_schema"', "response_format")
    kind = value["type"]
    extra = sorted(set(value) - {"type", "json_schema", "schema"})
    if extra or (kind != "json_schema" and "json_schema" in value) or (kind != "json_object" and "schema" in value):
        raise bad_request(f"response_format of type {kind[:40]!r} does not take {', '.join(extra) or 'that field'}",
                          "response_format")
    if kind == "text":
        return None
    if kind == "json_object":  # llama.cpp's form may carry a schema: enforced, never dropped
        schema = value.get("schema")
        return _spec("json_object", None, "response_format") if schema is None else _spec(
            "json_schema", schema, "response_format")
    if kind != "json_schema":
        raise bad_request(f'response_format type {kind[:40]!r} is not supported: use "text", "json_object" or '
                          f'"json_schema"', "response_format")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise bad_request('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                          "response_format")
    unknown = sorted(set(js) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad_request(f"response_format.json_schema has unknown fields {unknown[:4]}", "response_format")
    if js.get("strict") not in (None, True, False):
        raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
    if "schema" not in js:
        raise bad_request("response_format.json_schema needs a schema (an object, JSON Schema)", "response_format")
    return _spec("json_schema", js["schema"], "response_format")


def _vllm(value) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object with one of json, regex, choice, grammar, "
                          "json_object", "structured_outputs")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(_VLLM_KINDS) - _VLLM_ACCEPTED)
    if unknown:
        raise bad_request(f"structured_outputs: {', '.join(unknown[:4])} not supported (ringshm reads json, regex, "
                          f"choice, grammar, json_object; JSON whitespace is bounded, see the README)",
                          "structured_outputs")
    kinds = [k for k in given if k in _VLLM_KINDS]
    if len(kinds) != 1:  # vLLM's rule too: exactly one kind
        raise bad_request(f"structured_outputs: give one of json, regex, choice, grammar, json_object, got "
                          f"{', '.join(kinds) or 'none'}", "structured_outputs")
    name = kinds[0]
    if name == "json_object" and given[name] is not True:
        raise bad_request("structured_outputs.json_object must be true", "structured_outputs")
    return _spec(_VLLM_KINDS[name], None if name == "json_object" else given[name], "structured_outputs")


def structured_output(body) -> tuple[StructuredOutput | None, str | None]:
    """The ``StructuredOutput`` a request body asks for and the field that asked (for errors), or ``(None,
    None)``. Reads ``body.response_format`` and, from the body's extra fields, ``structured_outputs``,
    ``json_schema`` and ``grammar``.

    Raises:
        ApiError 400: a malformed field (named), or more than one of them set.
    """
    extra = body.model_extra or {}
    found = []
    if body.response_format is not None:
        found.append((_response_format(body.response_format), "response_format"))
    if extra.get("structured_outputs") is not None:
        found.append((_vllm(extra["structured_outputs"]), "structured_outputs"))
    if extra.get("json_schema") is not None:  # {} is a schema: any JSON value
        found.append((_spec("json_schema", extra["json_schema"], "json_schema"), "json_schema"))
    if extra.get("grammar") is not None:  # "" is refused as empty, not read as absent
        found.append((_spec("grammar", extra["grammar"], "grammar"), "grammar"))
    found = [(so, param) for so, param in found if so is not None]
    if len(found) > 1:
        raise bad_request(f"give one constraint on the output, got {' and '.join(p for _, p in found)}",
                          found[1][1])
    return found[0] if found else (None, None)
