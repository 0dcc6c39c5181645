"""Single-process SmolLM2 (Q4_1 GGUF; ours reads the Q4_1 / Q8_0 blocks, transformers dequantizes to fp32):
greedy decode tok/s and prefill tok/s of our all-layers ``StageModel`` vs transformers, same prompt, same
run. Figures only, never asserted on time.

Goal (issue 3): decode tok/s >= 2 x transformers'.
Run: ``python -m pytest bench/bench_model.py --benchmark-only -s``.

The two models are timed alternately inside each round, so load from other processes on a shared machine
hits both alike; medians and bests over rounds are recorded (``figures``) and their ratios printed.
Decode: prefill the prompt (untimed), then time ``N_DECODE`` greedy steps (n = 1, KV cache, argmax of the
last logits). Prefill: one forward over the whole prompt from an empty cache.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from ringshm.model.packaged import default_model_path
from ringshm.model.stage_model import StageModel
from ringshm.model.tokenizer import load_tokenizer

PROMPT = ("Explain how a single-producer single-consumer ring buffer in shared memory lets two processes "
          "exchange messages without locks. Cover the head and tail indices, memory ordering, what happens "
          "when the ring is full, and how a consumer waits for new data without spinning forever.")
N_DECODE = 32
ROUNDS = 5


@pytest.fixture(scope="module")
def prompt_ids() -> torch.Tensor:
    tok = load_tokenizer(default_model_path())
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    return torch.tensor(list(ids), dtype=torch.int64)  # [T]


@pytest.fixture(scope="module")
def ours() -> StageModel:
    return StageModel.from_path(default_model_path(), max_rows=1, max_seq_len=512)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def _decode_ours(model: StageModel, prompt: torch.Tensor) -> float:
    model.reset()
    token = model.forward(prompt, 0, 0).token_ids[-1:]
    t0 = time.perf_counter()
    for i in range(N_DECODE):
        token = model.forward(token, 0, len(prompt) + i).token_ids
    return (time.perf_counter() - t0) / N_DECODE


def _decode_hf(model, prompt: torch.Tensor) -> float:
    out = model(prompt[None], use_cache=True)
    token, cache = out.logits[0, -1].argmax().view(1, 1), out.cache
    t0 = time.perf_counter()
    for _ in range(N_DECODE):
        out = model(token, cache=cache, use_cache=True)
        token, cache = out.logits[0, -1].argmax().view(1, 1), out.cache
    return (time.perf_counter() - t0) / N_DECODE


def _matmul_floor(model: StageModel, prompt: torch.Tensor) -> float:
    """Per-token time of the decode matmuls alone (every packed weight once, M = 1, as the stage calls them):
    what the rest of a decode token (attention, norms, Python) adds on top is decode time minus this."""
    x, a, g = torch.zeros(1, model.config.hidden), torch.zeros(1, model.config.q_dim), \
        torch.zeros(1, model.config.intermediate)
    t0 = time.perf_counter()
    for _ in range(N_DECODE // 4):
        for layer in model.layers:
            layer.wqkv.matmul(x)
            layer.wo.matmul(a, residual=x)
            layer.w_gate_up.matmul(x)
            layer.w_down.matmul(g, residual=x)
        model.lm_head.matmul(x)
    return (time.perf_counter() - t0) / (N_DECODE // 4)


def _prefill_ours(model: StageModel, prompt: torch.Tensor) -> float:
    model.reset()
    t0 = time.perf_counter()
    model.forward(prompt, 0, 0)
    return (time.perf_counter() - t0) / len(prompt)


def _prefill_hf(model, prompt: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(prompt[None]).logits[0, -1].argmax()
    return (time.perf_counter() - t0) / len(prompt)


def _alternate(benchmark, figures, what: str, contenders: dict, prompt, goal: str = "") -> None:
    """Time each ``contenders[name](prompt)`` in turn, ROUNDS rounds; record per-token medians and bests."""
    times: dict[str, list[float]] = {name: [] for name in contenders}

    @torch.inference_mode()
    def one_round():
        for name, fn in contenders.items():
            times[name].append(fn(prompt))

    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1)
    for name, ts in times.items():
        ts = ts[-ROUNDS:]  # drop the warm-up round
        med, best = statistics.median(ts), min(ts)
        figures.record_value(f"model.{what}.{name}", med, tok_s=1 / med, best_tok_s=1 / best,
                             threads=torch.get_num_threads(), prompt_tokens=len(prompt))
        benchmark.extra_info[f"{name}_tok_s"] = 1 / med
        print(f"\n{what} {name}: {1 / med:.1f} tok/s median, {1 / best:.1f} best ({len(prompt)}-token prompt, "
              f"{torch.get_num_threads()} threads)")
    ratio_best = min(times["transformers"][-ROUNDS:]) / min(times["stage_model"][-ROUNDS:])
    print(f"{what} tok/s StageModel / transformers: best-of-{ROUNDS} ratio {ratio_best:.2f}")
    figures.ratio(f"model {what} tok/s: StageModel / transformers", f"model.{what}.transformers",
                  f"model.{what}.stage_model", goal)


def test_decode_stage_model_vs_transformers(benchmark, figures, ours, hf, prompt_ids):
    """Decode, plus the matmul floor: the quantized matmuls alone (97 MB of Q4_1 / Q8_0 weights per token for
    SmolLM2); decode / floor says how much of a token is everything else."""
    _alternate(benchmark, figures, "decode", {
        "stage_model": lambda p: _decode_ours(ours, p),
        "transformers": lambda p: _decode_hf(hf, p),
        "matmul_floor": lambda p: _matmul_floor(ours, p),
    }, prompt_ids, ">= 2")
    figures.ratio("model decode: StageModel time / its matmuls alone", "model.decode.stage_model",
                  "model.decode.matmul_floor")


def test_prefill_stage_model_vs_transformers(benchmark, figures, ours, hf, prompt_ids):
    _alternate(benchmark, figures, "prefill", {
        "stage_model": lambda p: _prefill_ours(ours, p),
        "transformers": lambda p: _prefill_hf(hf, p),
    }, prompt_ids)
