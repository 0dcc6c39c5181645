"""An OpenAI-compatible HTTP server over an ``AsyncEngine`` (FastAPI + uvicorn, pydantic request models).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming as server-sent events ending with
``data: [DONE]``, or one JSON body), ``GET /health`` (200 only while every stage is alive; 503 naming the
dead one), ``GET /metrics`` (Prometheus text format); and in ``ringshm.server.info``: ``GET /v1/models`` and
``GET /v1/models/{id}`` (one model object per served name, ``--served-model-name a b``; 404 for another),
``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes), ``GET /version``.

Request fields (OpenAI's): ``model``, ``messages`` / ``prompt``, ``max_tokens`` (``max_completion_tokens``),
``temperature`` (default 1.0, as OpenAI; 0 = greedy), ``top_p``, ``seed``, ``stop`` (a string or a list),
``n`` (1 .. 16), ``stream``, ``stream_options.include_usage``, ``logit_bias`` (``{"token id": bias in [-100,
100]}``), ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]), chat's ``logprobs`` + ``top_logprobs``
(0 .. 20), completions' ``logprobs`` (0 .. 20), ``echo`` (with ``max_tokens`` 0: score the prompt) and a list
of prompts; vLLM's extensions: ``top_k``, ``repetition_penalty`` (> 0), ``min_tokens`` (0 .. max_tokens),
``ignore_eos``, ``return_tokens_as_token_ids``. Structured output: ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and
llama.cpp's ``json_schema`` / ``grammar`` (``ringshm.server.structured``; compiled off the loop, a schema or grammar
that does not compile is a 400 naming the field and, for a keyword that cannot be enforced, its JSON pointer).
Tools: ``tools``, ``tool_choice``, ``parallel_tool_calls`` (``ringshm.server.tools``: the model's own format
where its chat template has one (``hermes``, ``llama3_json``, ``mistral``; ``--tool-call-parser`` to choose),
else a generic JSON format; held to a grammar built from the tools). How choices, logprobs and echo are answered:
``ringshm.server.openai_responses``.
A request with a logit control (not ``ignore_eos``) or logprobs is decoded without speculation even when the server
has ``--spec``. ``max_tokens`` defaults to the rest of the context for chat and to 16 for completions (OpenAI's
defaults). Types are strict (400 naming the field). Fields ringshm does not implement are refused (400 naming them)
unless at their neutral value (``ringshm.server.openai_schema.UNSUPPORTED``), and so are other servers' fields that
would change the answer (``FOREIGN_FIELDS``: vLLM's old ``guided_*``, ``chat_template_kwargs``, ...); other unknown
fields are ignored.
A request's ``model`` may be any served name (none: the first); the response echoes it.
Message contents are tokenised as plain text (special-token spellings cannot forge turns), on a tokenizer
thread, off the loop.

Limits: bodies over ``max_body_bytes`` get 413; a request waiting for a row past ``max_queue_wait_s`` 503,
a full queue 429, both with ``Retry-After``. A stage that holds an op past ``op_timeout_s``: 503 for the open
and new requests and on ``/health`` (naming it) until it answers again. A dead stage or a failed dispatcher
(``DispatcherFailed``): 503, then ``on_stage_died`` (``ringshm.server.process.serve`` shuts down and exits 3 for
a supervisor to restart it).

Usage: every non-streaming response has ``usage``. A stream always carries ``usage`` on the ``finish_reason``
chunk of its last choice to finish; with ``stream_options: {"include_usage": true}`` an extra chunk with empty
``choices`` and the usage follows it, as OpenAI sends it.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, never a stack trace: malformed
JSON or fields (``n`` over 16, ``top_logprobs`` over 20, ...), prompt + max_tokens over the context or the KV
pool: 400; unknown model: 404; queue full: 429; a stage died: 503. An error after a stream has started is sent as
one ``data: {"error": ...}`` event.

A client that disconnects mid-stream cancels its own request only (Starlette cancels the response's body
iterator, and cancelling the iterator cancels the request's row in the dispatcher). SIGTERM / Ctrl-C: uvicorn
stops accepting, lets open responses finish for up to ``graceful_s``, then the lifespan shutdown closes the
``AsyncEngine`` (and with it the engine: stages reaped, segments unlinked); ``ringshm.server.process.serve``
returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ringshm.engine.async_engine import AsyncEngine
from ringshm.errors import DispatcherFailed, MissingChatTemplate, StageDied, StageStalled
from ringshm.model.tokenizer import encode_chat, load_tokenizer
from ringshm.server.connection import ClientWatch
from ringshm.server.http_errors import add_error_handlers
from ringshm.server.info import add_info_routes
from ringshm.server.middleware import BodyLimit, CountRequests, Metrics
from ringshm.server.openai_responses import ClientGone, Job, OpenAIRequest, TokenText
from ringshm.server.openai_schema import (
    RETRY_AFTER_S,
    ApiError,
    ChatRequest,
    CompletionRequest,
    RequestBody,
    ServedModels,
    bad_request,
    engine_error,
    plain_messages,
)
from ringshm.server.structured import structured_output
from ringshm.server.tokenizing import Tokenizers
from ringshm.server.tool_formats import detect_format, make_format
from ringshm.server.tools import ToolPlan, tool_plan
from ringshm.transport.segment import is_alive

log = logging.getLogger("ringshm.server.app")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


# ----------------------------------------------------------------------------------------------- the app
STAGE_WATCH_S = 0.25  # how often the server looks for a dead stage while no request would notice one


def create_app(aengine: AsyncEngine, model_names: str | Sequence[str], *, spec: str | None = None,
               spec_k: int = 4, spec_depth: int = 1, graceful_s: float = 0.0, max_body_bytes: int = 2 * 1024 * 1024,
               on_stage_died: Callable[[StageDied | DispatcherFailed], None] | None = None,
               tool_call_parser: str = "auto") -> FastAPI:
    """The FastAPI app serving ``aengine`` under ``model_names`` (one name or several aliases; responses
    echo the one a request used, the first when it names none). Its lifespan shutdown closes ``aengine``
    (open requests get ``graceful_s`` more to finish). ``spec="ngram"`` decodes greedy requests
    speculatively with ``spec_k`` drafts per verify segment and ``spec_depth`` verify segments in flight.
    ``max_body_bytes``: larger request bodies get 413. ``on_stage_died``: called once, on the event loop,
    when a stage is found dead or the dispatcher failed (``serve`` then shuts down and exits 3).
    ``tool_call_parser``: the tool-call format (``ringshm.server.tool_formats.FORMATS``), or "auto": the one the
    chat template writes (``detect_format``).

    Raises:
        ValueError: ``max_body_bytes`` below 1, or an unknown ``tool_call_parser``.
    """

    async def watch_stages():
        while True:
            await asyncio.sleep(STAGE_WATCH_S)
            try:
                aengine.check_stages()
            except (StageDied, DispatcherFailed) as exc:
                log.error("%s: the server stops (exit status 3) for its supervisor to restart it", exc)
                on_stage_died(exc)
                return
            except StageStalled:
                pass

    @asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.create_task(watch_stages()) if on_stage_died is not None else None
        yield
        if watcher is not None:
            watcher.cancel()
        await aengine.aclose(wait_s=graceful_s)
        tokenizers.shutdown()

    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    try:
        engine_tokenizer = aengine.engine.tokenizer
    except ValueError:  # a checkpoint without a tokenizer: no chat, so no tools either
        engine_tokenizer = None
    tool_format = make_format(detect_format(getattr(engine_tokenizer, "chat_template", None))
                              if tool_call_parser == "auto" else tool_call_parser, engine_tokenizer)
    app = FastAPI(title="ringshm", lifespan=lifespan, docs_url=None, redoc_url=None)
    metrics = Metrics(aengine, spec is not None)
    served = ServedModels(model_names, aengine.max_seq_len, int(time.time()))
    app.state.metrics = metrics

    def too_large() -> JSONResponse:
        err = ApiError(413, f"request body over the server's limit of {max_body_bytes} bytes (ringshm serve "
                            f"--max-body-bytes): send a shorter prompt", "invalid_request_error", None,
                       "request_too_large")
        return JSONResponse(err.body(), status_code=413)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, error=too_large)
    app.add_middleware(CountRequests, metrics=metrics)

    add_error_handlers(app, too_large)

    @app.get("/health")
    async def health():
        stages = _stage_status(aengine.engine)
        try:
            aengine.check_stages()
        except StageDied as exc:
            return JSONResponse({"status": "unhealthy", "message": str(exc), "dead_stage": exc.stage,
                                 "stages": stages}, status_code=503)
        except DispatcherFailed as exc:
            return JSONResponse({"status": "unhealthy", "message": str(exc), "stages": stages}, status_code=503)
        except StageStalled as exc:
            return JSONResponse({"status": "unhealthy", "message": str(exc), "stalled_stage": exc.stage,
                                 "stages": stages}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok", "stages": stages, "running": aengine.n_running, "waiting": aengine.n_waiting}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def check_room(n_prompts: int, body: RequestBody) -> None:
        """Refuse (400) a request with more streams than the server runs and queues at once: checked before
        anything is tokenised (a list of 120,000 prompts is refused from its length)."""
        per_prompt = 1 if body.temperature == 0 else body.n
        room = aengine.engine.config.max_rows + aengine.max_waiting
        if n_prompts * per_prompt > room:
            raise bad_request(f"{n_prompts} prompt(s) x n={body.n} {'sampled ' if per_prompt > 1 else ''}choices "
                              f"need {n_prompts * per_prompt} rows; this server runs and queues at most {room} at "
                              f"once", "n" if per_prompt > 1 else "prompt")

    async def constraint(body: RequestBody, tools: ToolPlan | None = None):
        """The request's ``StructuredOutput`` and the field that set it (``ringshm.server.structured``, or the
        ``tools``' answer format), compiled off the event loop (the tokenizer's tables on first use, then the
        grammar: llguidance drops the GIL), so that starting its stream finds it cached. Raises ApiError 400 naming
        the field."""
        so, param = structured_output(body)
        if tools is not None:
            if so is not None:
                raise bad_request(f"tools and {param} both constrain the answer: give one", param)
            try:  # each tool's schema alone first: errors name the tool; then the answer's (too long: 400)
                for where, check in tools.checks():
                    try:
                        await asyncio.to_thread(aengine.engine.grammars.compile, check)
                    except ValueError as exc:
                        raise bad_request(f"{where}: {exc}", "tools") from None
                so, param = tools.constraint(), "tools"
            except ValueError as exc:
                raise bad_request(f"tools: {exc}", "tools") from None
        if so is not None and body.stop:
            raise bad_request(f"stop strings would cut the answer {param} holds to where its grammar does not end: "
                              f"drop stop or {param}", "stop")
        if so is not None:
            t0 = time.perf_counter()
            try:
                grammars = aengine.engine.grammars
                compiled = grammars.n_compiled
                await asyncio.to_thread(grammars.compile, so)
            except ValueError as exc:
                raise bad_request(str(exc), param) from None
            if grammars.n_compiled > compiled:
                metrics.grammar_compile.observe(time.perf_counter() - t0)
            metrics.structured_requests.inc()
        return so, param

    def start(body: RequestBody, prompts: list[list[int]], max_tokens: int | None, default_max: int,
              logprobs: int | None = None, prompt_logprobs: int | None = None,
              constraint=(None, None)) -> list[Job]:
        """Check what the engine does not, then start the request's streams (``ringshm.server.openai_responses``:
        one per prompt x n, one per prompt when greedy). ``constraint``: ``(StructuredOutput, its field)`` or
        ``(None, None)``. Raises ApiError, with nothing left running."""
        limit = aengine.max_seq_len
        score_only = max_tokens == 0
        greedy = body.temperature == 0
        per_prompt = 1 if greedy else body.n
        check_room(len(prompts), body)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        controls = body.logit_controls()
        base = dict(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=stop, **controls)
        if logprobs is not None:
            base["logprobs"] = logprobs
        if prompt_logprobs is not None:
            base["prompt_logprobs"] = prompt_logprobs
        if body.cache_salt is not None:
            base["cache_salt"] = body.cache_salt
        if constraint[0] is not None:
            base["structured_output"] = constraint[0]
        processes_logits = any(k != "ignore_eos" for k in controls)
        if spec is not None and greedy and not processes_logits and logprobs is None and prompt_logprobs is None:
            base.update(spec=spec, spec_k=spec_k, spec_depth=spec_depth)  # spec verifies the plain argmax
        n_maxes = []
        for p, ids in enumerate(prompts):
            n_max = 1 if score_only else (
                max_tokens if max_tokens is not None else max(1, min(default_max, limit - len(ids))))
            if score_only and len(ids) + 1 > limit:
                which = f"prompt {p}: " if len(prompts) > 1 else ""
                raise bad_request(f"{which}scoring a prompt (max_tokens 0) takes one position past it: at most "
                                  f"{limit - 1} prompt tokens in this model's {limit}-token context, got {len(ids)}",
                                  "prompt", "context_length_exceeded")
            if len(ids) + n_max > limit:
                which = f"prompt {p}: " if len(prompts) > 1 else ""
                raise bad_request(f"{which}this model's maximum context length is {limit} tokens; you requested "
                                  f"{len(ids) + n_max} tokens ({len(ids)} in the prompt, {n_max} for max_tokens): "
                                  f"shorten the prompt or lower max_tokens", "max_tokens", "context_length_exceeded")
            if body.min_tokens > (0 if score_only else n_max):
                raise bad_request(f"min_tokens ({body.min_tokens}) must be at most max_tokens "
                                  f"({0 if score_only else n_max})",
                                  "min_tokens")
            n_maxes.append(n_max)
        jobs: list[Job] = []
        try:
            for p, (ids, n_max) in enumerate(zip(prompts, n_maxes)):
                for j in range(per_prompt):
                    index = p * body.n + j
                    seed = None if body.seed is None else body.seed + index  # choice i: seed + i
                    chunks = aengine.stream(ids, n_max, seed=seed, **base)
                    indexes = list(range(p * body.n, (p + 1) * body.n)) if greedy else [index]
                    jobs.append(Job(chunks, indexes, p, ids))
        except Exception as exc:
            for job in jobs:
                job.stream.cancel()
            err = engine_error(exc)
            if err.param == "structured_output":
                err.param = constraint[1]
            raise err from None
        metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))  # each prompt once, as usage counts it
        if logprobs is not None or prompt_logprobs is not None:
            metrics.logprob_requests.inc()
        return jobs

    token_text: list[TokenText] = []

    async def respond(watch: ClientWatch, body: RequestBody, jobs: list[Job], kind: str, n_choices: int,
                      echoes: list[str | None], logprobs: int | None, score_only: bool = False,
                      tools: ToolPlan | None = None):
        """The answer of a started request: its SSE stream or its body; 499 when its client went away (its
        streams are cancelled at once, wherever they are: ``ClientWatch``). Stops ``watch`` when the answer
        ends."""
        streaming = False
        try:
            if logprobs is not None and not token_text:  # its own tokenizer: the loop's thread reads it
                token_text.append(TokenText(await tokenizers.run(0, lambda tok: load_tokenizer(
                    aengine.engine.model_path))))
            answer = OpenAIRequest(kind, served.pick(body.model), jobs, n_choices, echoes, logprobs, score_only,
                                   token_text[0] if token_text else None, metrics,
                                   body.stream_options is not None and body.stream_options.include_usage,
                                   int(time.time()), body.return_tokens_as_token_ids, watch, tools)
            if body.stream:
                try:
                    first = await answer.first()
                except ClientGone:
                    return PlainTextResponse("", status_code=499)
                streaming = True
                return StreamingResponse(_watched(answer.events(first), watch), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            out = await answer.body()
            return PlainTextResponse("", status_code=499) if out is None else out
        finally:
            if not streaming:
                watch.stop()

    tokenizers = Tokenizers(aengine.engine, aengine.max_seq_len)

    async def tokenize_text(n_chars: int, param: str, fn):
        """``fn(tokenizer)`` on a tokenisation lane, after the cheap check of the text's length (400 naming
        ``param`` when it cannot fit the context, or when the checkpoint has no tokenizer)."""
        try:
            why = tokenizers.too_long(n_chars)
        except ValueError as exc:  # the checkpoint carries no tokenizer
            raise bad_request(str(exc), param) from None
        if why is not None:
            raise bad_request(why, param, "context_length_exceeded")
        return await tokenizers.run(n_chars, fn)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        served.pick(body.model)
        body.refuse_unsupported()
        check_room(1, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens == 0:
            raise bad_request("max_tokens must be at least 1 for chat (0 is for completions with echo)", "max_tokens")
        k = body.logprob_k()
        messages = plain_messages(body.messages, tool_format)
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_format)
        if tools is not None:
            if k is not None:
                raise bad_request("logprobs are not returned with tool calls: drop logprobs or tools", "logprobs")
            messages = tools.messages(messages)
        so = await constraint(body, tools)
        watch = ClientWatch(request.receive)
        try:
            try:
                ids = await tokenize_text(sum(len(m["content"]) for m in messages), "messages",
                                          lambda tok: encode_chat(tok, messages,
                                                                  tools=tools and tools.template_tools()))
            except ApiError:
                raise
            except MissingChatTemplate as exc:  # a base model: no template at all (say so, not "the roles")
                raise bad_request(str(exc), "messages") from None
            except Exception as exc:  # the template refused the conversation (e.g. roles out of order)
                log.info("chat template refused a request: %s", exc)
                raise bad_request("messages do not fit the model's chat template (check the roles and their "
                                  "order)", "messages") from None
            if watch.gone:
                return PlainTextResponse("", status_code=499)
            jobs = start(body, [ids], max_tokens, aengine.max_seq_len, logprobs=k, constraint=so)
        except BaseException:
            watch.stop()
            raise
        return await respond(watch, body, jobs, "chat", body.n, [None] * body.n, k, tools=tools)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        served.pick(body.model)
        body.refuse_unsupported()
        many = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        prompts = body.prompt if many else [body.prompt]
        if body.max_tokens == 0 and not body.echo:
            raise bad_request("max_tokens 0 needs echo: true (it scores the prompt without generating)",
                              "max_tokens")
        check_room(len(prompts), body)
        so = await constraint(body)
        for i, prompt in enumerate(prompts):  # token-id prompts longer than the context, before any work
            if not isinstance(prompt, str) and len(prompt) > aengine.max_seq_len:
                raise bad_request(f"{f'prompt[{i}]: ' if many else ''}this model's maximum context length is "
                                  f"{aengine.max_seq_len} tokens; the prompt has {len(prompt)}", "prompt",
                                  "context_length_exceeded")
        watch = ClientWatch(request.receive)
        try:
            ids_list = []
            for i, prompt in enumerate(prompts):
                try:
                    if isinstance(prompt, str):
                        ids = await tokenize_text(len(prompt), "prompt",
                                                  lambda tok, p=prompt: aengine.engine.encode(p, tokenizer=tok))
                    else:  # ids are only checked against the vocabulary, off the loop all the same
                        ids = await tokenizers.run(len(prompt), lambda tok, p=prompt: aengine.engine.encode(p))
                    ids_list.append(ids)
                except ApiError as exc:
                    exc.message = f"prompt[{i}]: {exc.message}" if many else exc.message
                    raise
                except ValueError as exc:
                    raise bad_request(f"prompt[{i}]: {exc}" if many else str(exc), "prompt") from None
            echoes: list[str | None] = [None] * (len(prompts) * body.n)
            if body.echo:
                for i, (prompt, ids) in enumerate(zip(prompts, ids_list)):
                    text = prompt if isinstance(prompt, str) else await tokenizers.run(
                        len(ids), lambda tok, ids=ids: tok.decode(ids))
                    echoes[i * body.n: (i + 1) * body.n] = [text] * body.n
            if watch.gone:
                return PlainTextResponse("", status_code=499)
            k = body.logprobs
            jobs = start(body, ids_list, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs=k,
                         prompt_logprobs=k if body.echo else None, constraint=so)
        except BaseException:
            watch.stop()
            raise
        return await respond(watch, body, jobs, "completion", len(prompts) * body.n, echoes, k,
                             score_only=body.max_tokens == 0)

    add_info_routes(app, aengine, served, tokenizers, tokenize_text, tool_format)

    return app


async def _watched(events, watch: ClientWatch):
    """``events`` (an SSE body), stopping the client watch when they end (the response is complete then)."""
    try:
        async for event in events:
            yield event
    finally:
        watch.stop()


def _stage_status(engine) -> list[dict]:
    """``/health``'s stage list: ``Engine.stage_status`` (every node's stages), or this host's pids for an
    engine that has no such view (a test's fake)."""
    status = getattr(engine, "stage_status", None)
    if status is not None:
        return status()
    return [{"stage": i, "node": 0, "pid": pid, "alive": is_alive(pid), "seen": "process"}
            for i, pid in enumerate(engine.pids)]
