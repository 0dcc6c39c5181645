"""Golden tests of the ring engine (issue 4): greedy tokens from 1, 2, 3 and 5 stage processes equal the
transformers oracle's, tie-aware (conftest.assert_greedy_matches records any float tie).

One engine per stage count, module-scoped and parametrised, so only one is alive at a time.
"""

from __future__ import annotations

import pytest
import torch

from engine_prompts import long_user_message
from ringshm.engine.engine import Engine

N_SHORT = 16  # greedy tokens compared for the short prompts
N_LONG = 8  # and for the long one (its prefill dominates)


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": long_user_message()}],
                                        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(ids) >= 600, f"the long prompt must span many chunks, has {len(ids)} tokens"
    return torch.tensor(list(ids), dtype=torch.int64)


@pytest.fixture(scope="module", params=[1, 2, 3, 5], ids=lambda n: f"{n}stages")
def engine(request, model_path):
    with Engine(model_path, stages=request.param, prefill_chunk=64, prefill_depth=8, max_rows=2,
                max_seq_len=1024, progress=False) as eng:
        yield eng


def test_greedy_over_the_ring_equals_the_oracle_on_short_prompts(engine, prompts, oracle_greedy,
                                                                  assert_greedy_matches):
    for i, prompt in enumerate(prompts):
        result = engine.generate(prompt.tolist(), max_new_tokens=N_SHORT)
        ref = oracle_greedy(prompt, N_SHORT)
        label = f"{engine.config.stages} stages, prompt {i}"
        compared = assert_greedy_matches(torch.tensor(result.token_ids), ref, label)
        assert compared >= 1, f"{label}: nothing compared"


def test_greedy_over_the_ring_equals_the_oracle_on_a_prompt_spanning_many_chunks(engine, long_prompt,
                                                                                 oracle_greedy,
                                                                                 assert_greedy_matches):
    result = engine.generate(long_prompt.tolist(), max_new_tokens=N_LONG)
    assert result.n_prompt_tokens == len(long_prompt) >= 600
    ref = oracle_greedy(long_prompt, N_LONG)
    assert_greedy_matches(torch.tensor(result.token_ids), ref, f"{engine.config.stages} stages, long prompt")
