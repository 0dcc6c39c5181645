"""The OpenAI API's wire side for ``ringshm.server.app``: pydantic request models (``ChatRequest``,
``CompletionRequest``, and vLLM's ``TokenizeRequest`` / ``DetokenizeRequest``), the served model names
(``ServedModels``: aliases, model objects, 404 for an unknown name) and OpenAI-shaped errors (``ApiError``),
with the mapping from engine exceptions to HTTP statuses: bad input 400, queue full 429, a dead or stalled
stage, a failed dispatcher, a queue wait past its limit or a closing engine 503, a failed request 500.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, model_validator

from ringshm.errors import (
    DispatcherFailed,
    EngineClosed,
    QueueFull,
    QueueTimeout,
    RequestFailed,
    StageDied,
    StageStalled,
)
from ringshm.generation_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
)
from ringshm.model.tokenizer import check_text


# ------------------------------------------------------------------------------------------ request models
def _number(value):
    """A JSON number (not a bool, not a string such as "NaN"); NaN / infinity are refused by the field."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {value!r}")
    return value


def _check_prompt(value):
    """A completions prompt that is not empty, and a list of prompts of one kind (strings or id lists)."""
    if isinstance(value, list):
        if not value or any(isinstance(p, list) and not p for p in value):
            raise ValueError("the prompt is empty: give a string, a list of token ids, or a non-empty list of either")
        if any(isinstance(p, list) for p in value) and not all(isinstance(p, list) for p in value):
            raise ValueError("a list of prompts holds strings or token-id lists, not both")
    return value


def _int64(value: int) -> int:
    """An int inside int64; a larger one is refused without being written into the message (Python cannot turn
    an int of over 4,300 digits into text)."""
    if not -(2**63) <= value < 2**63:
        raise ValueError("must fit in 64 bits (|value| < 2**63)")
    return value


Number = Annotated[float, BeforeValidator(_number)]
Int = Annotated[int, Strict(), AfterValidator(_int64)]
Bool = Annotated[bool, Strict()]
Text = Annotated[str, Strict(), Field(min_length=1)]
StopText = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_STOP_CHARS)]
Bias = Annotated[float, BeforeValidator(_number), Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
TopK = Annotated[int, Strict(), Field(ge=0, le=MAX_TOP_LOGPROBS)]
TokenIds = Annotated[list[Int], Field(min_length=1)]
MAX_N = 16  # choices per prompt (n): each sampled choice holds a row of its own

# Fields OpenAI (or vLLM) define that ringshm does not implement: accepted only at their neutral value,
# otherwise 400 naming the field (never silently ignored). field -> (neutral test, what to say)
UNSUPPORTED = {
    "min_p": (lambda v: v == 0, "min_p is not supported (use 0)"),
    "best_of": (lambda v: v is None or v == 1, "best_of must be 1"),
    "suffix": (lambda v: not v, "suffix is not supported"),
    "functions": (lambda v: not v, "functions (the legacy form of tools) are not supported"),
    "function_call": (lambda v: v is None or v == "none", 'function_call: functions are not supported (only '
                      '"none")'),
}


# Fields other servers read that would change the answer (vLLM's extra body, llama.cpp server's sampling and
# prompt fields). They come in as unknown fields of the body; each is refused with 400 naming it unless it is
# absent, null or neutral, never dropped: a vLLM `structured_outputs` with a `choice` of yes / no / maybe, once
# ignored, came back as free text. Unknown fields not named here (vLLM's `priority`, `request_id`, ...) are
# ignored. The fields that constrain the output (response_format, vLLM's structured_outputs, llama.cpp's
# json_schema / grammar) are read by ringshm.server.structured. field -> (neutral test, what to say)
FOREIGN_FIELDS = {
    **{name: (lambda v: False, f"{name} (vLLM's old guided decoding field) is not read: use structured_outputs "
              f"({{\"{name[7:]}\": ...}}) or response_format")
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "guided_decoding_backend": (lambda v: False, "guided_decoding_backend is not read: ringshm's grammar engine is "
                                "llguidance"),
    "allowed_token_ids": (lambda v: not v, "allowed_token_ids is not supported (logit_bias can exclude tokens)"),
    "bad_words": (lambda v: not v, "bad_words is not supported (logit_bias can exclude their tokens)"),
    "stop_token_ids": (lambda v: not v, "stop_token_ids is not supported (use stop strings)"),
    "logits_processors": (lambda v: not v, "logits_processors are not supported"),
    "include_stop_str_in_output": (lambda v: v is False, "include_stop_str_in_output is not supported (only false)"),
    "use_beam_search": (lambda v: v is False, "use_beam_search is not supported (only false)"),
    "length_penalty": (lambda v: v == 1, "length_penalty is not supported (it applies to beam search; use 1)"),
    "prompt_logprobs": (lambda v: False, "prompt_logprobs is not supported (completions: echo with logprobs)"),
    "typical_p": (lambda v: v == 1, "typical_p is not supported (use 1)"),
    "mirostat": (lambda v: v == 0, "mirostat is not supported (use 0)"),
    "repeat_penalty": (lambda v: v == 1, "repeat_penalty (llama.cpp's name) is not read: use repetition_penalty"),
    "chat_template": (lambda v: False, "chat_template is not supported: the model's own template is used"),
    "chat_template_kwargs": (lambda v: not v, "chat_template_kwargs are not supported: the model's own template "
                             "is rendered with its defaults"),
    "add_generation_prompt": (lambda v: v is True, "add_generation_prompt is not supported (only true)"),
    "continue_final_message": (lambda v: v is False, "continue_final_message is not supported (only false)"),
    "documents": (lambda v: not v, "documents are not supported"),
}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (OpenAI's extra last chunk with the usage)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: Bool = False


class RequestBody(BaseModel):
    """Fields both endpoints take. Types are strict: ``true`` is not an int, ``"8"`` not a number, and NaN /
    infinity are refused; a wrong type is a 400 naming the field. An explicit ``null`` is the field's default
    (OpenAI's fields are nullable). Unknown fields are kept (``model_extra``) for ``refuse_unsupported`` to check
    against ``FOREIGN_FIELDS``."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    model: Annotated[str, Strict()] | None = None
    max_tokens: Int | None = Field(None, ge=0)  # 0: completions with echo only (scoring the prompt)
    temperature: Number = Field(1.0, ge=0.0, le=min(2.0, MAX_TEMPERATURE), allow_inf_nan=False)  # < 0.01: 0.01
    top_p: Number = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: Int = Field(0, ge=0)
    seed: Int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Int = Field(1, ge=1, le=MAX_N)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, Bias] | None = None
    response_format: dict | None = None
    ignore_eos: Bool = False
    min_tokens: Int = Field(0, ge=0)
    repetition_penalty: Number = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                      allow_inf_nan=False)
    min_p: Number = Field(0.0, allow_inf_nan=False)
    return_tokens_as_token_ids: Bool = False  # vLLM's: logprob tokens read "token_id:<id>"
    cache_salt: Text | None = None  # vLLM's: a tenant's own prefix-cache chain (never hits another salt's blocks)

    def logit_controls(self) -> dict:
        """``GenerationParams`` keyword arguments of the logit controls set in the body: ``logit_bias`` with
        its JSON string keys as token ids, the penalties, ``min_tokens``, ``ignore_eos``. Raises a 400 naming
        ``logit_bias`` for a key that is not a decimal token id (ids past the vocabulary: the engine's check)."""
        out = {}
        if self.logit_bias:
            bias, spelled = {}, {}
            for key, value in self.logit_bias.items():
                if not (key.isascii() and key.isdigit() and len(key) <= 20):
                    raise bad_request(f"logit_bias keys must be token ids as decimal strings, got {key[:40]!r}",
                                      "logit_bias")
                token = int(key)
                if token in bias:
                    raise bad_request(f"logit_bias names token {token} twice ({spelled[token]!r} and {key!r}): "
                                      f"give each token once", "logit_bias")
                bias[token], spelled[token] = value, key
            out["logit_bias"] = bias
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                              ("min_tokens", 0), ("ignore_eos", False)):
            if getattr(self, name) != neutral:
                out[name] = getattr(self, name)
        return out

    def refuse_unsupported(self) -> None:
        """Raise a 400 naming the first field set to a value ringshm does not implement (``UNSUPPORTED``, and
        another server's field that would change the answer: ``FOREIGN_FIELDS``), or ``stream_options`` without
        ``stream`` (vLLM's rule)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be given with stream: true", "stream_options")
        for name, (neutral, what) in UNSUPPORTED.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                raise bad_request(what, name)
        for name, value in (self.model_extra or {}).items():
            if name in FOREIGN_FIELDS and not FOREIGN_FIELDS[name][0](value):
                raise bad_request(FOREIGN_FIELDS[name][1], name)


class _TextPart(BaseModel):
    """A content part: OpenAI's ``{"type": "text", "text": str}`` (other types are refused)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Annotated[str, Strict()]


class _Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Annotated[str, Strict()]
    arguments: Annotated[str, Strict()]


class _ToolCall(BaseModel):
    """An earlier assistant turn's call: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""

    model_config = ConfigDict(extra="ignore")

    id: Annotated[str, Strict()] | None = None
    type: Literal["function"] = "function"
    function: _Function


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Strict()] | list[_TextPart] | None = None
    tool_calls: list[_ToolCall] | None = None  # assistant
    tool_call_id: Annotated[str, Strict()] | None = None  # tool


def plain_messages(messages: list[_Message], fmt=None) -> list[dict]:
    """``[{"role", "content"}]`` for the chat template: text content parts joined, ``developer`` as ``system``, no
    content as "". Tool turns, with ``fmt`` a native ``ringshm.server.tool_formats.ToolFormat``, go to the template
    as transformers takes them (an assistant's ``tool_calls`` with their arguments parsed, a ``tool`` turn with its
    ``tool_call_id`` and the called function's ``name``); otherwise they become text any template takes
    (``ringshm.server.tools``' generic format): an assistant turn's ``tool_calls`` the JSON it would have written
    (``{"tool_calls": [{"name", "arguments"}]}`` after its content), a ``tool`` turn a user turn "Result of tool
    call <id>: <content>". Raises a 400 naming ``messages`` for text that is not valid Unicode (``check_text``),
    call arguments that are not JSON text (or, native, calls or ids that spell a special token), a ``tool`` turn without
    ``tool_call_id`` or ``tool_calls`` outside an assistant turn; a part that is not ``{"type": "text", "text":
    <string>}`` is refused by the schema."""
    native = fmt is not None and fmt.native
    out, names = [], {}  # names: call id -> function name, for the tool turns that answer them
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):  # content parts: text only
            content = "".join(p.text for p in content)
        try:
            check_text(content or "", f"messages[{i}].content")
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        content, role = content or "", "system" if m.role == "developer" else m.role
        extra: dict = {}
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", "messages")
            if native:
                spelled = fmt.spells_special(m.tool_call_id)
                if spelled:
                    raise bad_request(f"messages[{i}].tool_call_id spells the special token {spelled!r}: remove it",
                                      "messages")
                extra = {"tool_call_id": m.tool_call_id, **({"name": names[m.tool_call_id]}
                                                           if m.tool_call_id in names else {})}
            else:
                role, content = "user", f"Result of tool call {m.tool_call_id}: {content}"
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only an assistant message carries tool_calls", "messages")
            try:
                calls = [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                         for c in m.tool_calls]
            except ValueError:
                raise bad_request(f"messages[{i}].tool_calls: function.arguments must be JSON text",
                                  "messages") from None
            if native:
                spelled = fmt.spells_special(json.dumps([calls, [c.id for c in m.tool_calls]], ensure_ascii=False))
                if spelled:
                    raise bad_request(f"messages[{i}].tool_calls spell the special token {spelled!r}, which the "
                                      f"chat template would read as the token itself: remove it", "messages")
                names.update({c.id: c.function.name for c in m.tool_calls if c.id})
                extra = {"tool_calls": [{**({"id": c.id} if c.id else {}), "type": "function",
                                         "function": call} for c, call in zip(m.tool_calls, calls)]}
            else:
                content += json.dumps({"tool_calls": calls}, ensure_ascii=False)
        out.append({"role": role, "content": content, **extra})
    return out


class ChatRequest(RequestBody):
    """Chat's fields: ``logprobs`` (bool) and ``top_logprobs`` (0 .. 20, only with ``logprobs``)."""

    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: Bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    logprobs: Bool | None = None
    top_logprobs: TopK | None = None

    def logprob_k(self) -> int | None:
        """The top-k count of the answer's logprobs (None: none asked). Raises a 400 naming
        ``top_logprobs`` when it is set without ``logprobs: true`` (OpenAI's rule)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(RequestBody):
    """Completions' fields: ``prompt`` (a string, a list of token ids, or a list of either: one choice per
    prompt x n), ``logprobs`` (top-k count 0 .. 20: OpenAI's legacy API stops at 5, vLLM's default at 20),
    ``echo``."""

    prompt: Annotated[Annotated[str, Strict()] | TokenIds | list[Annotated[str, Strict()]] | list[TokenIds],
                      BeforeValidator(_check_prompt)]
    echo: Bool = False
    logprobs: TopK | None = None
    best_of: Int | None = None
    suffix: Annotated[str, Strict()] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: ``prompt`` (tokenised as ``/v1/completions`` does) or ``messages`` (through
    the chat template, as ``/v1/chat/completions`` does), exactly one of them. ``add_special_tokens`` is
    accepted only at the value ringshm tokenises with (vLLM's defaults: true for a prompt, false for
    messages); ``refuse_unsupported`` says so."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Strict()] | None = None
    prompt: Annotated[str, Strict()] | None = None
    messages: list[_Message] | None = Field(None, min_length=1)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise a 400 unless exactly one of ``prompt`` / ``messages`` is given, or for an
        ``add_special_tokens`` ringshm does not tokenise with."""
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt (a string) or messages (a chat)",
                              "prompt" if self.prompt is not None else "messages")
        chat = self.messages is not None
        if self.add_special_tokens is not None and self.add_special_tokens != (not chat):
            raise bad_request(f"add_special_tokens must be {str(not chat).lower()} with "
                              f"{'messages' if chat else 'prompt'} (the tokens the "
                              f"{'chat ' if chat else ''}completions endpoint uses)", "add_special_tokens")


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: ``tokens``, ids in the tokenizer's vocabulary."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Strict()] | None = None
    tokens: list[Int]


class ServedModels:
    """The names a server answers to (``--served-model-name a b``): each is listed by ``/v1/models``, a
    request's ``model`` may be any of them, and a response echoes the one it used (the first without)."""

    def __init__(self, names: str | Sequence[str], max_model_len: int, created: int):
        names = [names] if isinstance(names, str) else list(dict.fromkeys(names))
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"model names must be non-empty strings, got {names!r}")
        self.names, self.max_model_len, self.created = names, max_model_len, created

    def pick(self, requested: str | None) -> str:
        """The name a request's ``model`` names (the first name when ``None``); 404 for any other."""
        if requested is None:
            return self.names[0]
        if requested not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise ApiError(404, f"the model {requested!r} does not exist; this server serves {served}",
                           "not_found_error", "model", "model_not_found")
        return requested

    def card(self, name: str) -> dict:
        """OpenAI's model object for ``name`` (plus vLLM's ``max_model_len``)."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "ringshm",
                "max_model_len": self.max_model_len}


class ApiError(Exception):
    """An error answered as OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` (seconds) for a 429 / 503 the client should retry."""
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


RETRY_AFTER_S = 1  # Retry-After on 429 and on a 503 the server expects to clear (queue wait, a stalled stage)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def engine_error(exc: BaseException) -> ApiError:
    """The HTTP error of an exception raised by the ``AsyncEngine``."""
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), "rate_limit_error", None, "queue_full", RETRY_AFTER_S)
    if isinstance(exc, QueueTimeout):
        return ApiError(503, str(exc), "service_unavailable", None, "queue_timeout", RETRY_AFTER_S)
    if isinstance(exc, StageStalled):
        return ApiError(503, str(exc), "service_unavailable", None, "stage_stalled", RETRY_AFTER_S)
    if isinstance(exc, StageDied):
        return ApiError(503, str(exc), "service_unavailable", None, "stage_died")
    if isinstance(exc, DispatcherFailed):
        return ApiError(503, str(exc), "service_unavailable", None, "dispatcher_failed")
    if isinstance(exc, EngineClosed):
        return ApiError(503, str(exc), "service_unavailable", None, "shutting_down")
    if isinstance(exc, (ValueError, TypeError)):
        return bad_request(str(exc), getattr(exc, "param", None))
    if isinstance(exc, RequestFailed):
        return ApiError(500, str(exc), "server_error", None, "request_failed")
    return ApiError(500, "internal server error", "server_error")
