"""Every supported family on ringshm's own layer loop (issue 21), on the zoo's tiny random-weight models
(``tests/zoo.py``: an HF directory and a Q4_K_M-like GGUF of the same function, transformers fp32 as the oracle):

- greedy 32 tokens tie-aware equal to the oracle, from the HF directory and from the GGUF;
- the same bytes at 1 and 2 stages and whatever the prefill chunking;
- a stream's bytes alone equal its bytes beside 4 batch-mates in every step op (batch invariance);
- through the engine's processes for one family per source (2 stages, 4 streams at once).
"""

from __future__ import annotations

import pytest
import torch

from ringshm.model.loader import Checkpoint
from ringshm.model.reference import greedy_generate
from ringshm.model.stage_model import StageModel
from ringshm.transport.messages import WANT_LAST
from zoo import FAMILIES, prompt_ids

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT_LEN, N_NEW, MAX_SEQ = 16, 32, 64


def _stages(path, splits: tuple[int, ...]) -> list[StageModel]:
    """The model at ``path`` cut at the given layer boundaries (``()``: one stage), sharing one load."""
    ckpt = Checkpoint.open(path)
    cfg = ckpt.config
    full = ckpt.load_stage((0, cfg.n_layers), True, True)
    bounds = [0, *splits, cfg.n_layers]
    return [StageModel(cfg, (a, b), a == 0, b == cfg.n_layers, 5, MAX_SEQ,
                       weights=full.select((a, b), a == 0, b == cfg.n_layers)) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_the_oracle_and_is_the_same_at_one_and_two_stages(zoo, family, source,
                                                                        assert_greedy_matches):
    model = zoo(family)
    path = model.hf_dir if source == "hf" else model.gguf_path
    one = _stages(path, ())
    n_layers = one[0].config.n_layers
    two = _stages(path, (n_layers // 2,))
    for seed in (0, 1):
        prompt = prompt_ids(PROMPT_LEN, one[0].config.vocab, seed)
        ids = torch.tensor(prompt)
        alone = greedy_generate(one, ids, N_NEW)
        assert torch.equal(greedy_generate(two, ids, N_NEW, prefill_chunk=5), alone), "2 stages, chunks of 5"
        assert torch.equal(greedy_generate(one, ids, N_NEW, prefill_chunk=3), alone), "chunks of 3"
        assert_greedy_matches(alone, model.oracle_greedy(prompt, N_NEW), f"{family} {source} seed {seed}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_stream_beside_four_batch_mates_gets_the_bytes_it_gets_alone(zoo, family):
    stage = _stages(zoo(family).gguf_path, ())[0]
    prompts = [prompt_ids(PROMPT_LEN - r, stage.config.vocab, 10 + r) for r in range(5)]  # unequal lengths
    alone = greedy_generate([stage], torch.tensor(prompts[0]), N_NEW)
    stage.reset()
    out = stage.step(torch.tensor([t for p in prompts for t in p]),
                     [(r, 0, len(p), WANT_LAST) for r, p in enumerate(prompts)])
    tokens = [[int(t)] for t in out.token_ids]
    for i in range(N_NEW - 1):
        out = stage.step(torch.tensor([t[-1] for t in tokens]),
                         [(r, len(p) + i, 1, WANT_LAST) for r, p in enumerate(prompts)])
        for t, new in zip(tokens, out.token_ids.tolist()):
            t.append(new)
    assert tokens[0] == alone.tolist()


@pytest.mark.parametrize("family, source", [("gemma3", "gguf"), ("qwen3", "hf")])
def test_the_engine_serves_a_family_over_two_stage_processes_byte_identical_to_in_process(zoo, family, source):
    from ringshm.engine.engine import Engine

    model = zoo(family)
    path = model.hf_dir if source == "hf" else model.gguf_path
    stages = _stages(path, ())
    prompts = [prompt_ids(PROMPT_LEN, stages[0].config.vocab, 20 + i) for i in range(4)]
    want = []
    for p in prompts:
        stages[0].reset()
        want.append(greedy_generate(stages, torch.tensor(p), N_NEW).tolist())
    with Engine(model=str(path), stages=2, max_rows=4, max_seq_len=MAX_SEQ, prefill_chunk=8,
                progress=False) as engine:
        out = engine.generate_batch(prompts, max_new_tokens=N_NEW, ignore_eos=True)
    assert [r.token_ids for r in out.results] == want
