"""Structured output (issue 30), figures only, on the default model (1 stage, 2 threads): decode tok/s of 100 %
JSON-schema streams against the same streams unconstrained, at 1 and 16 streams (goal >= 0.95: vLLM loses 17-33 %);
the mask time per constrained token; grammar compile time p50 / p99 over the test corpus and the tool schemas (goal
p99 < 20 ms); the first structured request's TTFT on a fresh engine (the tokenizer's tables are built then) against
a warm one.

Both sides generate ``N_NEW`` tokens per stream: the unconstrained with ``ignore_eos``, the constrained under a
schema whose shortest document is longer than ``N_NEW`` tokens, so neither stops early. Each JSON / free figure is
the median of paired rounds (free, JSON, JSON, free, the order flipped each round: ``Figures.paired_ratio``).

Through a server (``test_server_json_vs_free``): ``SERVER_CLIENTS`` concurrent streaming chat clients against
``ringshm serve`` (1 stage, the default model), each sending free and JSON-schema requests (vLLM's
``structured_outputs.json`` extra body) in paired rounds; output tok/s per kind. With ``--peer-url URL`` (an
option of bench/conftest.py: vLLM's CPU build on the same weights, ``../shared/peers/vllm-cpu.sh``, as
bench_server.py) the same load runs against the peer first, and the table gets each server's JSON / free ratio and
ringshm / peer under JSON load.

Run: ``python -m pytest bench/bench_structured.py --benchmark-only -s -p no:cacheprovider [--peer-url URL]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

from conftest import cpu_label, percentile
from ringshm.engine.engine import Engine
from ringshm.engine.grammar import GrammarCompiler
from ringshm.generation_params import StructuredOutput as SO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server_structured import TOOLS  # noqa: E402
from test_structured import CORPUS, PERSON  # noqa: E402

N_NEW = 64
LONG = SO("json_schema", {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "minLength": 8, "maxLength": 40}, "minItems": 40, "maxItems": 40}},
    "required": ["notes"], "additionalProperties": False})
PROMPT = "List forty short notes about the sea as JSON."
_ENGINE: list[Engine] = []


@pytest.fixture(scope="module")
def engine():
    eng = Engine(stages=1, max_rows=16, max_seq_len=512, progress=False)
    _ENGINE.append(eng)
    yield eng
    eng.close()


ROUNDS = {1: 32, 16: 8}  # paired rounds per stream count (each: free, json, json, free or the reverse)


@pytest.mark.parametrize("n_streams", [1, 16])
def test_decode_constrained_vs_free(benchmark, figures, engine, n_streams):
    """Free and constrained runs paired round by round, A B B A with the order flipped each round, and the figure
    the median of the rounds' own ratios (``Figures.paired_ratio``: the VM's speed drifts by +-15 % within minutes,
    which a ratio of two medians lets in)."""
    ids = engine.encode(PROMPT, chat=True)
    kinds = {"free": {"ignore_eos": True}, "json": {"structured_output": LONG}}
    pairs: list[tuple[float, float]] = []
    flip = [False]

    def once(kind: str) -> float:
        out = engine.generate_batch([ids] * n_streams, N_NEW, **kinds[kind])
        assert all(r.n_output_tokens == N_NEW for r in out.results), "a stream stopped early"
        # one stream: its decode rate, (n - 1) / (t_last - t_first); many: output tokens over the run
        return out.results[0].tpot_s if n_streams == 1 else 1 / out.output_tok_s

    def run():
        order = ["json", "free", "free", "json"] if flip[0] else ["free", "json", "json", "free"]
        flip[0] = not flip[0]
        got = {"free": 0.0, "json": 0.0}
        for kind in order:
            got[kind] += once(kind) / 2
        pairs.append((got["free"], got["json"]))

    benchmark.pedantic(run, rounds=ROUNDS[n_streams], warmup_rounds=1)
    pairs = pairs[1:]  # the warm-up round left out
    for kind, col in (("free", 0), ("json", 1)):
        median = statistics.median(p[col] for p in pairs)
        figures.record_value(f"decode.{n_streams}.{kind}", median, tok_s=1 / median)
        print(f"\n{cpu_label()}\ndecode.{n_streams}.{kind}: {1 / median:.1f} tok/s")
    # seconds per token free / json = the constrained streams' speed over the free ones'
    figures.paired_ratio(f"decode tok/s json_schema / free, {n_streams} stream(s)", pairs, ">= 0.95")


def test_mask_time_per_constrained_token(engine, figures):
    streams = [engine._make_stream(i, -1, PROMPT, engine_params()) for i in range(4)]
    from ringshm.engine.engine import BatchStream

    run = BatchStream(engine, streams, engine.config.prefill_depth, None)
    list(run)
    tokens = sum(len(s.tokens) for s in streams)
    per_token_ms = 1e3 * sum(s.grammar.mask_s for s in streams) / tokens
    figures.summary.append(f"mask time per constrained token: {per_token_ms:.3f} ms ({tokens} tokens, "
                           f"{cpu_label()})")
    print(f"\nmask time per constrained token: {per_token_ms:.3f} ms")


def engine_params():
    from ringshm.generation_params import GenerationParams

    return GenerationParams(max_new_tokens=N_NEW, chat=True, structured_output=LONG)


def test_compile_time_over_the_corpus(engine, figures):
    from ringshm.server.tool_formats import FORMATS, make_format
    from ringshm.server.tools import tool_plan

    specs = [SO("json_schema", s) for s in CORPUS] + [SO("json_schema", PERSON), SO("json_object"),
                                                      SO("regex", r"[0-9]{3}-[0-9]{4}"),
                                                      SO("choice", ["yes", "no", "maybe"])]
    specs += [tool_plan(TOOLS, choice, None, make_format(name, engine.tokenizer)).constraint()
              for choice in ("auto", "required") for name in FORMATS]
    times = []
    for _ in range(5):
        compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab, engine.eos_ids)
        compiler.tokenizer  # the tables, built once per engine: not a compile
        for spec in specs:
            t0 = time.perf_counter()
            compiler.compile(spec)
            times.append(time.perf_counter() - t0)
    p50, p99 = percentile(times, 0.5) * 1e3, percentile(times, 0.99) * 1e3
    figures.summary.append(f"grammar compile over {len(specs)} specs x 5: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
                           f"(goal p99 < 20 ms)")
    print(f"\ncompile p50 {p50:.2f} ms p99 {p99:.2f} ms")


def test_cold_vs_warm_first_structured_request(figures):
    with Engine(stages=1, max_rows=2, max_seq_len=512, progress=False) as eng:
        ids = eng.encode(PROMPT, chat=True)
        eng.generate(ids, 2)  # the engine itself warm: only the grammar side is cold
        spec = SO("json_schema", PERSON)
        cold = eng.generate(ids, 4, structured_output=spec)
        t0 = time.perf_counter()
        warm = eng.generate(ids, 4, structured_output=spec)
        t_warm_call = time.perf_counter() - t0
    figures.summary.append(f"first structured request TTFT: cold {cold.ttft_s * 1e3:.0f} ms (tokenizer tables + "
                           f"compile), warm {warm.ttft_s * 1e3:.0f} ms (call {t_warm_call * 1e3:.0f} ms)")
    print(f"\ncold TTFT {cold.ttft_s * 1e3:.0f} ms, warm {warm.ttft_s * 1e3:.0f} ms")


SERVER_CLIENTS = 8
SERVER_ROUNDS = 5  # paired rounds (A B B A)


def _server_round(url: str, model: str, json_schema: bool) -> tuple[int, float]:
    """``SERVER_CLIENTS`` clients at once, one streamed request each; (completion tokens, wall seconds)."""
    import openai

    from conftest import run_together

    tokens: list[int] = []
    extra = {"structured_outputs": {"json": LONG.spec}} if json_schema else {"ignore_eos": True}

    def client(i: int) -> None:
        c = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=300)
        stream = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"{PROMPT} ({i})"}],
                                           max_tokens=N_NEW, temperature=0, stream=True, extra_body=extra,
                                           stream_options={"include_usage": True})
        usage = None
        for chunk in stream:
            usage = chunk.usage or usage
        tokens.append(usage.completion_tokens)
        c.close()

    wall = run_together([lambda i=i: client(i) for i in range(SERVER_CLIENTS)])
    assert len(tokens) == SERVER_CLIENTS, "a client failed: see its traceback above"
    return sum(tokens), wall


def test_server_json_vs_free(benchmark, figures, request):
    """Each server alone on the machine (the peer first, when given), free and JSON rounds interleaved."""
    benchmark.pedantic(lambda: _servers_json_vs_free(figures, request.config.getoption("--peer-url")), rounds=1,
                       warmup_rounds=0)


def _servers_json_vs_free(figures, peer: str | None) -> None:
    from contextlib import nullcontext

    import openai

    from conftest import ringshm_server

    results: dict[str, dict[str, float]] = {}
    for name in (["peer"] if peer else []) + ["ringshm"]:
        server = ringshm_server("--stages", "1", "--max-rows", "16", "--max-seq-len", "1024") if name == "ringshm" \
            else nullcontext()
        with server as base:
            url = f"{base}/v1" if name == "ringshm" else peer.rstrip("/")
            model = openai.OpenAI(base_url=url, api_key="x", max_retries=0).models.list().data[0].id
            _server_round(url, model, True)  # warm: the grammar compiled, the engine's first batch done
            pairs: list[tuple[float, float]] = []  # (free, json) seconds per output token, each round A B B A
            for r in range(SERVER_ROUNDS):
                got = {"free": 0.0, "json": 0.0}
                for kind in ("json", "free", "free", "json") if r % 2 else ("free", "json", "json", "free"):
                    n, wall = _server_round(url, model, kind == "json")
                    got[kind] += wall / n / 2
                pairs.append((got["free"], got["json"]))
            results[name] = {k: 1 / statistics.median(p[i] for p in pairs) for i, k in enumerate(("free", "json"))}
        for kind, tok_s in results[name].items():
            figures.record_value(f"server.{name}.{kind}", 1 / tok_s, tok_s=tok_s)
        figures.paired_ratio(f"{name} server, {SERVER_CLIENTS} clients: output tok/s JSON / free", pairs,
                             ">= 0.95" if name == "ringshm" else "")
        print(f"\n{cpu_label()}\n{name}: free {results[name]['free']:.1f} tok/s, JSON {results[name]['json']:.1f}")
    if peer:
        figures.ratio(f"JSON load, {SERVER_CLIENTS} clients: output tok/s ringshm / peer", "server.peer.json",
                      "server.ringshm.json")
