"""From a validated OpenAI request to its answer: the engine streams it needs (one per prompt x ``n``), their
chunks merged, and the choices built as OpenAI's bodies or SSE events, logprobs and echo included.
``ringshm.server.app`` validates the fields and calls ``OpenAIRequest``.

Choices: a request has ``len(prompts) x n`` choices, choice ``p * n + j`` being the j-th of prompt p (OpenAI's
and vLLM's order). A sampled choice is its own stream with its own row and seed (``seed + index`` when the
request has a seed, so the same request gets the same choices), prefilled once per choice: sharing the
prompt's prefill between them is not implemented. A greedy request (``temperature`` 0) would answer n
identical choices, so it runs one stream per prompt and copies its chunks to the n choices.

Logprobs (``ringshm.engine.logprobs``) are laid out as OpenAI's two shapes: chat's ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [k entries]}], "refusal": null}`` and legacy completions' ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}, k entries plus the chosen token], "text_offset"}``. A
token's text is its own bytes decoded as UTF-8 (a piece of a multi-byte character reads as U+FFFD; chat's
``bytes`` holds the exact bytes); ``text_offset`` is each token's offset in the choice's text, counted over
those token texts (as vLLM does). With ``echo`` a completion's text and logprobs start with the prompt's,
its first token scored ``null``. ``max_tokens`` 0 (echo only) scores the prompt: one token is generated
and not returned (``finish_reason`` "length", ``completion_tokens`` 0).

Usage counts each prompt once and every choice's tokens; ``prompt_tokens_details.cached_tokens`` counts, per
prompt once, the tokens every stream of it took from the prefix cache (the least over its choices: a prompt
that one choice had to compute is not free). In a stream the last choice to finish carries the
request's usage on its ``finish_reason`` chunk (and ``include_usage`` adds OpenAI's extra chunk).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field

from ringshm.engine.logprobs import TokenLogprob
from ringshm.server.openai_schema import engine_error
from ringshm.server.tool_formats import ToolCallStream
from ringshm.server.tools import ToolPlan


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed: the character standing for each byte -> the byte (Radford et
    al. 2019, openai/gpt-2 ``encoder.py``'s ``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Each token id's own bytes and text, cached: byte-level BPE tokenizers map their symbols back to bytes;
    others decode the one token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._bytes_of = _byte_decoder() if type(decoder).__name__ == "ByteLevel" else None
        self._cache: dict[int, bytes] = {}

    def bytes(self, token: int) -> bytes:
        if token not in self._cache:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if self._bytes_of is not None and piece is not None and all(c in self._bytes_of for c in piece):
                self._cache[token] = bytes(self._bytes_of[c] for c in piece)
            else:
                self._cache[token] = self.tokenizer.decode([token]).encode("utf-8")
        return self._cache[token]

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", "replace")


@dataclass
class Job:
    """One engine stream (``RequestStream``) of prompt ``prompt_index`` (its ids ``prompt_ids``) and the
    choice indexes it answers (n of them for greedy n > 1)."""

    stream: object
    indexes: list[int]
    prompt_index: int
    prompt_ids: list[int]
    cached_tokens: int = 0  # prompt tokens its stream took from the prefix cache (known once it finishes)


@dataclass
class _Choice:
    index: int
    echo: str | None  # the prompt's text, when echoing
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    offset: int = 0  # text_offset of the next token (completions logprobs)
    started: bool = False


class ClientGone(Exception):
    """The request's client disconnected: its streams are cancelled, nothing more will be answered."""


class Merged:
    """The chunks of several ``RequestStream``s as one async iterator of ``(job index, Chunk)``, in the order
    they arrive; the first error of any stream is raised. ``cancel()`` cancels every stream; a wait for the next
    chunk then raises ``ClientGone``."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(jobs)
        self._tasks = [asyncio.ensure_future(self._pump(i, job.stream)) for i, job in enumerate(jobs)]

    async def _pump(self, i: int, stream) -> None:
        try:
            async for chunk in stream:
                self._queue.put_nowait((i, chunk))
        except Exception as exc:
            self._queue.put_nowait((i, exc))
            return
        self._queue.put_nowait((i, None))

    def __aiter__(self) -> "Merged":
        return self

    async def __anext__(self):
        while self._open or not self._queue.empty():
            i, item = await self._queue.get()
            if isinstance(item, ClientGone):
                raise item
            if item is None:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.cancel()
                raise item
            return i, item
        raise StopAsyncIteration

    def cancel(self) -> None:
        for t in self._tasks:
            t.cancel()
        for job in self.jobs:
            job.stream.cancel()
        if self._open:
            self._open = 0
            self._queue.put_nowait((-1, ClientGone("the client went away")))


class OpenAIRequest:
    """One chat or completions request being answered: its jobs, their merged chunks, and the body or the SSE
    events built from them (module docstring).

    Args:
        kind: "chat" or "completion". model_id: the name echoed. jobs: the streams started for it.
        n_choices: choices in all. echoes: per choice, the prompt text to echo (None: no echo).
        logprobs: None, or the top-k count the answer shows. score_only: ``max_tokens`` 0 (echo only).
        token_text: ``TokenText`` of the tokenizer. metrics: the server's ``Metrics``.
        include_usage: ``stream_options.include_usage``. tokens_as_ids: vLLM's ``return_tokens_as_token_ids``:
            each logprob token reads ``"token_id:<id>"`` instead of its text.
        watch: the request's ``ClientWatch``: when the client goes away, every stream of the request is cancelled
            at once (waiting, prefilling or decoding) and counted "cancelled"; the answer then ends.
        tools: the request's ``ringshm.server.tools.ToolPlan`` (None: no tools): each choice's message carries its
            parsed ``tool_calls`` and content; a stream sends calls as they are generated. A marker of its format
            that is a special token (not decoded) is put back into the text the reader sees.
    """

    def __init__(self, kind: str, model_id: str, jobs: list[Job], n_choices: int, echoes: list[str | None],
                 logprobs: int | None, score_only: bool, token_text: TokenText, metrics, include_usage: bool,
                 created: int, tokens_as_ids: bool = False, watch=None, tools: ToolPlan | None = None):
        self.kind, self.model_id, self.jobs, self.tools = kind, model_id, jobs, tools
        self._tool_streams: dict[int, ToolCallStream] = {}
        self.logprobs, self.score_only, self.tt, self.metrics = logprobs, score_only, token_text, metrics
        self.include_usage, self.tokens_as_ids = include_usage, tokens_as_ids
        self.choices = [_Choice(i, echoes[i]) for i in range(n_choices)]
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = created
        self.merged = Merged(jobs)
        self._prev_s: dict[int, float] = {}
        self._n_open = n_choices
        self._ended = False  # answered in full, failed, or its client went away
        if watch is not None:
            watch.on_gone(self._client_gone)

    def _client_gone(self) -> None:
        """Cancel every stream of the request now; its open choices count as "cancelled"."""
        if not self._ended:
            self._ended = True
            self.metrics.finished.labels("cancelled").inc(self._n_open)
            self.merged.cancel()

    # ------------------------------------------------------------------------------------------- usage
    def usage(self) -> dict:
        """OpenAI's usage: each prompt counted once, every choice's returned tokens, and the prompt tokens
        served from the prefix cache (module docstring)."""
        prompt = sum(len(ids) for ids in {j.prompt_index: j.prompt_ids for j in self.jobs}.values())
        cached: dict[int, int] = {}
        for j in self.jobs:
            cached[j.prompt_index] = min(cached.get(j.prompt_index, j.cached_tokens), j.cached_tokens)
        done = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    # ---------------------------------------------------------------------------------------- logprobs
    def _payload(self, c: _Choice, tokens: list[int], lps: list[TokenLogprob | None]) -> dict:
        """``lps`` (of ``tokens``; None for a prompt's first) in the endpoint's logprobs shape: chat's content
        entries, or completions' four lists with text offsets continuing from the choice's."""
        tt = self.tt
        name = (lambda t: f"token_id:{t}") if self.tokens_as_ids else tt.text
        if self.kind == "chat":
            return {"content": [{"token": name(lp.token_id), "logprob": lp.logprob,
                                 "bytes": list(tt.bytes(lp.token_id)),
                                 "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(tt.bytes(t))}
                                                  for t, v in lp.top]} for lp in lps if lp is not None],
                    "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(tokens, lps):
            text = name(token)
            out["tokens"].append(text)
            out["text_offset"].append(c.offset)
            c.offset += len(tt.text(token))
            if lp is None:  # a prompt's first token: nothing before it to score it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            top: dict[str, float] = {}
            for t, v in lp.top:  # most likely first: where two ids read as the same text, the likelier stays
                top.setdefault(name(t), v)
            top.setdefault(text, lp.logprob)  # the chosen token is always listed (OpenAI: up to k + 1 entries)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
        return out

    def _on_chunk(self, j: int, chunk) -> list[tuple[_Choice, str, dict | None, str | None]]:
        """Apply one job's chunk to its choices: ``(choice, text, logprobs or None, finish_reason)`` per
        choice, the echo (prompt text and logprobs) first on a choice's first chunk."""
        job = self.jobs[j]
        if chunk.result is not None:
            job.cached_tokens = chunk.result.n_cached_tokens
        self.metrics.on_chunk(chunk, self._prev_s.get(j), generated=not self.score_only)
        self._prev_s[j] = chunk.time_s
        if chunk.prompt_logprobs is not None:
            self.metrics.prompt_logprob_tokens.inc(len(chunk.prompt_logprobs) - 1)
        out = []
        for i in job.indexes:
            c = self.choices[i]
            text, tokens, lps = "", [], []
            if not c.started:
                c.started = True
                if c.echo is not None:
                    text = c.echo
                    if self.logprobs is not None:
                        tokens = list(job.prompt_ids)
                        lps = list(chunk.prompt_logprobs or [None] * len(tokens))
            if not self.score_only:
                if self.tools is not None and self.tools.fmt.marker_ids:
                    text += self.tools.fmt.marker_ids.get(chunk.token_id, "")
                text += chunk.text
                c.completion_tokens += 1
                if self.logprobs is not None:
                    tokens.append(chunk.token_id)
                    lps.append(chunk.logprob)
            c.text.append(text)
            payload = self._payload(c, tokens, lps) if self.logprobs is not None else None
            finish = None
            if chunk.finish_reason is not None:
                finish = c.finish_reason = "length" if self.score_only else chunk.finish_reason
                self._n_open -= 1
                self.metrics.finished.labels(finish).inc()  # per choice, as usage counts them
            out.append((c, text, payload, finish))
        return out

    # ------------------------------------------------------------------------------------------ answers
    def _choice_body(self, c: _Choice, logprobs) -> dict:
        body = {"index": c.index, "finish_reason": c.finish_reason, "logprobs": logprobs}
        text = "".join(c.text)
        if self.kind == "chat" and self.tools is not None:
            content, calls, body["finish_reason"] = self.tools.parse(text, c.finish_reason)
            body["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        elif self.kind == "chat":
            body["message"] = {"role": "assistant", "content": text}
        else:
            body["text"] = text
        return body

    def _tool_deltas(self, c: _Choice, text: str, finish: str | None) -> tuple[list[dict], str | None]:
        """A tool-format choice's stream deltas for its new ``text`` (``ringshm.server.tool_formats.ToolCallStream``:
        content and calls as they are generated), and at its finish what is left (held-back text, a generic reply's
        content, or the raw text when the answer is not the format). Returns (deltas, finish_reason), both as
        ``ToolPlan.parse`` reads the whole text."""
        stream = self._tool_streams.setdefault(c.index, ToolCallStream(self.tools.fmt))
        stream.feed(text)
        if finish is None:
            return stream.deltas(), None
        content, _, finish = stream.result(finish)
        deltas = stream.deltas()
        if content and not stream.calls and content != stream.content:  # the raw text, not the format
            deltas.append({"content": content})
        return deltas, finish

    async def body(self) -> dict | None:
        """The non-streaming body; None when the client went away (every stream is cancelled then).

        Raises:
            ApiError: a stream failed (its engine error).
        """
        merged_lps: dict[int, dict | None] = {c.index: None for c in self.choices}
        try:
            async for j, chunk in self.merged:
                for c, _, payload, _ in self._on_chunk(j, chunk):
                    merged_lps[c.index] = _join(merged_lps[c.index], payload)
        except ClientGone:
            return None
        except Exception as exc:
            raise engine_error(exc) from None
        finally:
            self._ended = True
            self.merged.cancel()
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_id,
                "choices": [self._choice_body(c, merged_lps[c.index]) for c in self.choices],
                "usage": self.usage()}

    async def first(self):
        """Wait for the first chunk (before the stream's headers go out, so a request that never starts gets
        its status). Raises ApiError, or ClientGone when the client went away meanwhile."""
        try:
            return await self.merged.__anext__()
        except StopAsyncIteration:
            return None
        except ClientGone:
            raise
        except Exception as exc:
            self._ended = True
            self.merged.cancel()
            raise engine_error(exc) from None
        except BaseException:
            self._client_gone()
            raise

    async def events(self, first):
        """The SSE body (bytes events): a role chunk per choice (chat), one event per chunk and choice, usage
        on the last choice's finish chunk, then ``[DONE]``. An error after the headers is one error event."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        head = {"id": self.id, "object": obj, "created": self.created, "model": self.model_id}
        try:
            if self.kind == "chat":
                yield _event({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                   "finish_reason": None, "logprobs": None} for c in self.choices]})
            item = first
            while item is not None:
                j, chunk = item
                for c, text, payload, finish in self._on_chunk(j, chunk):
                    if self.tools is not None and self.kind == "chat":  # calls streamed as their JSON grows
                        deltas, finish = self._tool_deltas(c, text, finish)
                        for delta in deltas:
                            yield _event({**head, "choices": [{"index": c.index, "delta": delta, "finish_reason": None,
                                                               "logprobs": None}]})
                        text = ""
                    if not (text or finish is not None or payload):
                        continue
                    if self.kind == "chat":
                        choice = {"index": c.index, "delta": {"content": text} if text or finish is None else {},
                                  "finish_reason": finish, "logprobs": payload}
                    else:
                        choice = {"index": c.index, "text": text, "finish_reason": finish, "logprobs": payload}
                    event = {**head, "choices": [choice]}
                    if finish is not None and not self._n_open:
                        event["usage"] = self.usage()
                    yield _event(event)
                    if finish is not None and not self._n_open and self.include_usage:
                        yield _event({**head, "choices": [], "usage": self.usage()})
                item = await self.merged.__anext__() if self._n_open else None
        except StopAsyncIteration:
            pass
        except ClientGone:  # nobody reads the rest
            return
        except Exception as exc:  # after the headers: report in the stream
            self._ended = True
            yield _event(engine_error(exc).body())
        except BaseException:  # the client went away (Starlette cancels this generator): cancel ours only
            self._client_gone()
            raise
        finally:
            self._ended = True
            self.merged.cancel()
        yield b"data: [DONE]\n\n"


def _join(a: dict | None, b: dict | None) -> dict | None:
    """Two logprobs payloads of one choice, ``b`` after ``a``."""
    if a is None or b is None:
        return a if b is None else b
    return {k: (a[k] + b[k] if isinstance(a[k], list) else a[k]) for k in a}


def _event(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()
