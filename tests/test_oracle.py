"""Our all-layers StageModel on SmolLM2 (Q4_1 GGUF) against transformers fp32 from the same file."""

from __future__ import annotations

import pytest
import torch

from ringshm.model.reference import greedy_generate

pytestmark = pytest.mark.usefixtures("torch_one_thread")

N_GREEDY = 32


@torch.inference_mode()
def test_last_position_logits_match_transformers_within_1e_3(full_stage, oracle, prompts):
    for i, prompt in enumerate(prompts):
        ours = full_stage.forward(prompt, row=0, start=0, return_logits=True).logits
        ref = oracle(prompt[None]).logits[0, -1]
        err = (ours - ref).abs().max().item()
        assert err < 1e-3, f"prompt {i} ({len(prompt)} tokens): max |logit diff| {err:.3g}"


@torch.inference_mode()
def test_logits_match_transformers_at_a_random_token_prompt(full_stage, oracle):
    # Random ids exercise rows of the embedding and head that chat prompts never touch.
    prompt = torch.randint(0, full_stage.config.vocab, (97,), generator=torch.Generator().manual_seed(3))
    ours = full_stage.forward(prompt, row=1, start=0, return_logits=True).logits
    ref = oracle(prompt[None]).logits[0, -1]
    assert (ours - ref).abs().max().item() < 1e-3


@torch.inference_mode()
def test_verify_ids_at_all_positions_equal_the_oracle_argmax(full_stage, oracle, prompts):
    prompt = prompts[2]
    ours = full_stage.forward(prompt, row=0, start=0, all_positions=True)
    ref_logits = oracle(prompt[None]).logits[0]  # [T, vocab]
    assert ours.token_ids.shape == (len(prompt),)
    top2 = ref_logits.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) >= 1e-2
    assert torch.equal(ours.token_ids[decided], ref_logits.argmax(-1)[decided])


@torch.inference_mode()
def test_greedy_32_tokens_equal_transformers_greedy_up_to_float_ties(full_stage, oracle_greedy, prompts,
                                                                      assert_greedy_matches):
    for i, prompt in enumerate(prompts):
        full_stage.reset()
        ours = greedy_generate([full_stage], prompt, N_GREEDY)
        assert assert_greedy_matches(ours, oracle_greedy(prompt, N_GREEDY), f"prompt {i}") > 0


def test_the_oracle_tie_rule_can_fail(oracle_greedy, prompts, assert_greedy_matches):
    ref = oracle_greedy(prompts[0], N_GREEDY)
    wrong = ref.tokens.clone()
    step = int(torch.argmax(ref.margins))  # the most decided step: never a tie
    wrong[step] = (wrong[step] + 1) % 49152
    try:
        assert_greedy_matches(wrong, ref, "deliberately wrong")
    except AssertionError:
        return
    raise AssertionError("a wrong token at a decided step passed the tie-aware check")


@torch.inference_mode()
def test_fp16_kv_greedy_equals_transformers_greedy_up_to_float_ties(checkpoint, full_weights, oracle_greedy,
                                                                     prompts, assert_greedy_matches):
    """The engine's default KV dtype (EngineConfig.kv_cache_dtype): stored rounded to fp16, read exactly,
    attention in fp32. It stays on the fp32 oracle's greedy path up to float ties."""
    from ringshm.model.stage_model import StageModel

    cfg = checkpoint.config
    stage = StageModel(cfg, (0, cfg.n_layers), True, True, 1, 512, weights=full_weights, kv_dtype=torch.float16)
    assert stage.kv[0].k.dtype == torch.float16
    for i, prompt in enumerate(prompts):
        stage.reset()
        ours = greedy_generate([stage], prompt, N_GREEDY)
        assert assert_greedy_matches(ours, oracle_greedy(prompt, N_GREEDY), f"fp16 KV, prompt {i}") > 0
