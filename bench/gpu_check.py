"""The CUDA path in one short run: 2 stage processes on one GPU, greedy output against the transformers fp32
oracle (tie-aware, as tests/conftest.py), and decode tok/s. Run by bench/gpu_check.sh; exits non-zero on a
mismatch. CUDA stages keep the torch path (weights dequantized at load; batch invariance is a CPU guarantee).
"""

from __future__ import annotations

import sys
import time

import torch

TIE_MARGIN = 1e-2
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
N_NEW = 32


def oracle_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model(torch.tensor([ids]), use_cache=True)
    tokens, margins = [], []
    for _ in range(n):
        logits = out.logits[0, -1]
        top2 = logits.topk(2).values
        tokens.append(int(logits.argmax()))
        margins.append(float(top2[0] - top2[1]))
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens, margins


def main() -> int:
    from transformers import AutoModelForCausalLM

    from ringshm.engine.engine import Engine
    from ringshm.model.packaged import default_model_path

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device", file=sys.stderr)
        return 2
    path = default_model_path()
    oracle = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    failures = 0
    with Engine(path, stages=2, device="cuda", progress=False) as engine, torch.inference_mode():
        for text in PROMPTS:
            ids = engine.encode(text, chat=True)
            r = engine.generate(ids, max_new_tokens=N_NEW)
            ref, margins = oracle_greedy(oracle, ids, N_NEW)
            n = min(len(r.token_ids), len(ref))
            diverge = next((i for i in range(n) if r.token_ids[i] != ref[i]), None)
            if diverge is None:
                verdict = "equal"
            elif margins[diverge] < TIE_MARGIN:
                verdict = f"float tie at step {diverge} (oracle margin {margins[diverge]:.3g})"
            else:
                verdict = f"MISMATCH at step {diverge} (oracle margin {margins[diverge]:.3g})"
                failures += 1
            print(f"{text!r}: {verdict}; decode {r.decode_tok_s:.1f} tok/s, TTFT {r.ttft_s * 1e3:.0f} ms")
        t0 = time.perf_counter()
        r = engine.generate("Once upon a time", max_new_tokens=128)
        print(f"decode, 128 tokens: {r.decode_tok_s:.1f} tok/s ({time.perf_counter() - t0:.2f} s wall); "
              f"GPU {torch.cuda.get_device_name(0)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
