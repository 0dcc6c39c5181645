"""The OpenAI API's wire side for ``ringshm.server``: pydantic request models (``ChatRequest``,
``CompletionRequest``) and OpenAI-shaped errors (``ApiError``), with the mapping from engine exceptions to
HTTP statuses: bad input 400, queue full 429, a dead stage or a closing engine 503, a failed request 500.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ringshm.errors import EngineClosed, QueueFull, RequestFailed, StageDied


# ------------------------------------------------------------------------------------------ request models
class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None


class ChatRequest(RequestBody):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list | None = None


class CompletionRequest(RequestBody):
    prompt: str | list[int] | list[str]
    echo: bool = False


class ApiError(Exception):
    """An error answered as OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def engine_error(exc: BaseException) -> ApiError:
    """The HTTP error of an exception raised by the ``AsyncEngine``."""
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), "rate_limit_error", None, "queue_full")
    if isinstance(exc, StageDied):
        return ApiError(503, str(exc), "service_unavailable", None, "stage_died")
    if isinstance(exc, EngineClosed):
        return ApiError(503, str(exc), "service_unavailable", None, "shutting_down")
    if isinstance(exc, (ValueError, TypeError)):
        return bad_request(str(exc))
    if isinstance(exc, RequestFailed):
        return ApiError(500, str(exc), "server_error", None, "request_failed")
    return ApiError(500, "internal server error", "server_error")
