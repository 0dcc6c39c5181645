"""The endpoints of ``ringshm.server.app`` that describe the served model without generating: its names
(``GET /v1/models``, ``GET /v1/models/{id}``: OpenAI's model objects, one per ``--served-model-name`` alias;
404 in OpenAI's error shape for another id), ``GET /version`` (``{"version": ringshm.__version__}``) and its
tokenizer, ``POST /tokenize`` and ``POST /detokenize``.

Tokenizer shapes as vLLM's (``vllm/entrypoints/openai/protocol.py``, ``TokenizeRequest`` / ``DetokenizeRequest``):

    POST /tokenize    {"model"?, "prompt": str}                                  -> {"count", "max_model_len",
                      {"model"?, "messages": [...], "add_generation_prompt"?}        "tokens": [int, ...]}
    POST /detokenize  {"model"?, "tokens": [int, ...]}                           -> {"prompt": str}

The ids are the ones the generation endpoints would feed the model: a ``prompt`` as ``/v1/completions``
tokenises it (the engine's ``encode``), ``messages`` through the chat template as ``/v1/chat/completions``
does (``ringshm.model.tokenizer.encode_chat``, contents as plain text). ``/detokenize`` decodes with special tokens
kept (vLLM's ``tokenizer.decode``), so a tokenised chat reads back as its template. Both run on the server's
tokenisation lanes, off the event loop (``ringshm.server.tokenizing``). Errors: an unknown ``model`` 404; ids
outside the tokenizer's vocabulary, both or neither of ``prompt`` / ``messages``, text that is not valid
Unicode, a text longer than the context can hold: 400 naming the field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI

from ringshm.engine.async_engine import AsyncEngine
from ringshm.errors import MissingChatTemplate
from ringshm.model.tokenizer import encode_chat
from ringshm.server.openai_schema import (
    ApiError,
    DetokenizeRequest,
    ServedModels,
    TokenizeRequest,
    bad_request,
    plain_messages,
)
from ringshm.server.tokenizing import Tokenizers
from ringshm.version import __version__


def add_info_routes(app: FastAPI, aengine: AsyncEngine, served: ServedModels, tokenizers: Tokenizers,
                    tokenize_text: Callable[..., Awaitable], tool_format=None) -> None:
    """Register ``/v1/models``, ``/v1/models/{id}``, ``/version``, ``/tokenize`` and ``/detokenize`` on
    ``app``. Tokenisation runs on the generation endpoints' lanes (``ringshm.server.tokenizing``):
    ``tokenize_text(n_chars, param, fn)`` after the cheap length check, ``tokenizers.run`` for decoding.
    ``tool_format``: the server's ``ToolFormat``: messages' tool turns are rendered as chat renders them."""

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [served.card(name) for name in served.names]}

    @app.get("/v1/models/{name:path}")  # :path: a name may hold "/" (an HF repo id)
    async def model(name: str):
        return served.card(served.pick(name))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        served.pick(body.model)
        body.refuse_unsupported()
        if body.messages is not None:
            messages = plain_messages(body.messages, tool_format)
            try:
                ids = await tokenize_text(sum(len(m["content"]) for m in messages), "messages",
                                          lambda tok: encode_chat(tok, messages, body.add_generation_prompt))
            except ApiError:
                raise
            except MissingChatTemplate as exc:  # a base model: no template at all (say so, not "the roles")
                raise bad_request(str(exc), "messages") from None
            except Exception:  # the template refused the conversation (e.g. roles out of order)
                raise bad_request("messages do not fit the model's chat template (check the roles and their "
                                  "order)", "messages") from None
        else:
            try:
                ids = await tokenize_text(len(body.prompt), "prompt",
                                          lambda tok: aengine.engine.encode(body.prompt, tokenizer=tok))
            except ValueError as exc:
                raise bad_request(str(exc), "prompt") from None
        return {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        served.pick(body.model)
        try:
            return {"prompt": await tokenizers.run(len(body.tokens), lambda tok: decode(tok, body.tokens))}
        except ValueError as exc:
            raise bad_request(str(exc), "tokens") from None


def decode(tokenizer, ids: list[int]) -> str:
    """Text of ``ids``, special tokens kept (vLLM's ``/detokenize``).

    Raises:
        ValueError: an id outside the tokenizer's vocabulary ``[0, len(tokenizer))``, named by its index.
    """
    n_vocab = len(tokenizer)
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ValueError(f"tokens[{bad}] = {ids[bad]} is outside the vocabulary [0, {n_vocab})")
    return tokenizer.decode(ids)
