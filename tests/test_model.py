"""StageModel on SmolLM2: split and chunk invariance, the KV row rules and the segment table, ragged steps, bf16."""

from __future__ import annotations

import pytest
import torch

from ringshm.errors import KVRangeError
from ringshm.model.reference import greedy_generate, run_stages
from ringshm.model.stage_model import StageModel
from ringshm.transport.messages import WANT_NONE

pytestmark = pytest.mark.usefixtures("torch_one_thread")

N_GREEDY = 16


def _stages(cfg, weights, bounds, max_rows=1, max_seq_len=256):
    """Consecutive StageModels over ``bounds`` (e.g. [0, 10, 20, 30]) sharing the session's weights."""
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        first, last = a == 0, b == cfg.n_layers
        out.append(StageModel(cfg, (a, b), first, last, max_rows, max_seq_len,
                              weights=weights.select((a, b), first, last)))
    return out


@pytest.mark.parametrize("bounds", [
    [0, 15, 30], [0, 10, 20, 30], [0, 6, 12, 18, 24, 30], [0, 1, 29, 30],
], ids=["2_stages", "3_stages", "5_stages", "3_uneven_stages"])
@torch.inference_mode()
def test_layers_split_into_consecutive_stages_give_bitwise_identical_logits(full_stage, full_weights, prompts,
                                                                            bounds):
    stages = _stages(full_stage.config, full_weights, bounds)
    prompt = prompts[1]
    one = full_stage.forward(prompt, 0, 0, all_positions=True, return_logits=True)
    split = run_stages(stages, prompt, 0, 0, all_positions=True, return_logits=True)
    assert torch.equal(one.logits, split.logits) and torch.equal(one.token_ids, split.token_ids)
    for step in range(3):  # decode reads the KV each stage wrote
        pos, tok = len(prompt) + step, one.token_ids[-1:]
        one = full_stage.forward(tok, 0, pos, return_logits=True)
        split = run_stages(stages, tok, 0, pos, return_logits=True)
        assert torch.equal(one.logits, split.logits), f"decode step {step}"


@pytest.mark.parametrize("chunk", [1, 7, 64, None], ids=["chunk_1", "chunk_7", "chunk_64", "whole"])
@torch.inference_mode()
def test_prefill_in_chunks_gives_the_oracle_greedy_tokens(full_stage, prompts, oracle_greedy,
                                                          assert_greedy_matches, chunk):
    prompt = prompts[3]
    assert len(prompt) > 64
    ours = greedy_generate([full_stage], prompt, N_GREEDY, row=1, prefill_chunk=chunk)
    assert assert_greedy_matches(ours, oracle_greedy(prompt, N_GREEDY), f"prefill chunk {chunk}") > 0


@pytest.mark.parametrize("chunk", [1, 7, 64], ids=["chunk_1", "chunk_7", "chunk_64"])
@torch.inference_mode()
def test_chunked_prefill_gives_bitwise_the_hidden_states_and_logits_of_a_whole_prefill(
        checkpoint, full_weights, full_stage, prompts, chunk):
    """Batch invariance of every kernel: a position's bits do not depend on how many others share its op."""
    prompt = prompts[3]
    whole = full_stage.forward(prompt, 0, 0, all_positions=True, return_logits=True)
    for start in range(0, len(prompt), chunk):
        out = full_stage.forward(prompt[start:start + chunk], 1, start, all_positions=True, return_logits=True)
        assert torch.equal(out.token_ids, whole.token_ids[start:start + chunk])
    assert torch.equal(out.logits, whole.logits)
    first = StageModel(checkpoint.config, (0, 15), True, False, max_rows=1, max_seq_len=256,
                       weights=full_weights.select((0, 15), True, False))
    hidden_whole = first.forward(prompt, 0, 0)  # [n, hidden] after layer 14
    hidden = torch.cat([first.forward(prompt[s:s + chunk], 0, s) for s in range(0, len(prompt), chunk)])
    assert torch.equal(hidden, hidden_whole)


@pytest.mark.parametrize("chunk", [7, 64, None], ids=["chunk_7", "chunk_64", "whole"])
@torch.inference_mode()
def test_a_wanted_position_gets_the_bits_of_a_step_that_wants_every_position(full_stage, prompts, chunk):
    """The last stage runs its last layer past K / V only on the rows its head reads (``StageModel._native_layers``'
    ``wanted``): the last position's logits of a prefill that wants it alone (the chunks before it want none) equal
    bitwise those of one that wants every position (where every row runs the whole layer), and a decode step after
    each reads the same KV (the skipped rows' keys and values were written)."""
    prompt = prompts[3]
    every = full_stage.forward(prompt, 0, 0, all_positions=True, return_logits=True)
    size = chunk or len(prompt)
    for start in range(0, len(prompt), size):
        piece = prompt[start:start + size]
        if start + size < len(prompt):
            assert full_stage.step(piece, [(1, start, len(piece), WANT_NONE)]).token_ids.numel() == 0
    last = full_stage.forward(piece, 1, start, return_logits=True)
    assert torch.equal(last.logits, every.logits) and torch.equal(last.token_ids, every.token_ids[-1:])
    nxt = every.token_ids[-1:]
    a, b = (full_stage.forward(nxt, row, len(prompt), return_logits=True) for row in (0, 1))
    assert torch.equal(a.logits, b.logits)


# ---- KV row rules (a 2-layer stage over the real weights keeps these fast) ----------------------------


@pytest.fixture
def small(checkpoint, full_weights):
    cfg = checkpoint.config
    return StageModel(cfg, (0, 2), True, True, max_rows=3, max_seq_len=16,
                      weights=full_weights.select((0, 2), True, True))


def _snapshot(stage):
    return [t.clone() for kv in stage.kv for t in (kv.k, kv.v)], stage.fill.clone()


def _same(stage, snap) -> bool:
    tensors, fill = snap
    now = [t for kv in stage.kv for t in (kv.k, kv.v)]
    return torch.equal(fill, stage.fill) and all(torch.equal(a, b) for a, b in zip(tensors, now))


@torch.inference_mode()
def test_writing_below_the_length_overwrites_and_truncates_the_row(small):
    a, b = torch.arange(100, 110), torch.arange(200, 203)
    small.forward(a[:5], 0, 0)
    ref = small.forward(b, 0, 5, all_positions=True, return_logits=True)  # row 0: a[:5] + b
    small.forward(a, 1, 0)  # row 1: 10 positions of a, then roll back to 5 and write b
    assert small.row_length(1) == 10
    out = small.forward(b, 1, 5, all_positions=True, return_logits=True)
    assert small.row_length(1) == 8
    assert torch.equal(out.token_ids, ref.token_ids)
    assert (out.logits - ref.logits).abs().max().item() < 1e-4
    with pytest.raises(KVRangeError, match="do not hold the 9 positions"):
        small.forward(a[:1], 1, 9)


@torch.inference_mode()
def test_reading_past_what_was_written_raises_and_changes_nothing(small):
    small.forward(torch.arange(4), 0, 0)
    snap = _snapshot(small)
    with pytest.raises(KVRangeError, match="row 0, start 5"):
        small.forward(torch.arange(2), 0, 5)
    with pytest.raises(KVRangeError):
        small.forward(torch.arange(1), 2, 1)  # a fresh row has nothing to read
    assert _same(small, snap)
    small.forward(torch.arange(2), 0, 4)  # exactly at the length is a plain append
    assert small.row_length(0) == 6


@torch.inference_mode()
def test_writing_past_max_seq_len_raises_and_changes_nothing(small):
    small.forward(torch.arange(10), 0, 0)
    snap = _snapshot(small)
    with pytest.raises(KVRangeError, match="max_seq_len 16"):
        small.forward(torch.arange(7), 0, 10)
    with pytest.raises(KVRangeError, match="segment 1 .*max_seq_len 16"):  # nothing written, not even row 1
        small.step(torch.zeros(14, dtype=torch.int64), [(1, 0, 7, 0), (0, 10, 7, 1)])
    assert _same(small, snap)
    small.forward(torch.arange(6), 0, 10)  # up to the last position is fine
    assert small.row_length(0) == 16


@torch.inference_mode()
def test_a_bad_segment_table_is_refused_naming_the_segment(small):
    with pytest.raises(KVRangeError, match="row 3"):
        small.forward(torch.arange(2), 3, 0)
    with pytest.raises(ValueError, match="segment 1 .*once per op"):
        small.step(torch.zeros(2, dtype=torch.int64), [(0, 0, 1, 1), (0, 0, 1, 1)])
    with pytest.raises(ValueError, match="hold 3 tokens, the op carries 2"):
        small.step(torch.zeros(2, dtype=torch.int64), [(0, 0, 1, 1), (1, 0, 2, 1)])
    with pytest.raises(ValueError, match="segment 0 .*want"):
        small.step(torch.zeros(1, dtype=torch.int64), [(0, 0, 1, 4)])  # logits without an argmax position
    with pytest.raises(ValueError, match="at least one segment"):
        small.step(torch.zeros(1, dtype=torch.int64), [])
    assert [small.row_length(r) for r in range(3)] == [0, 0, 0]


@torch.inference_mode()
def test_reset_forgets_a_row_and_keeps_the_others(small):
    small.forward(torch.arange(4), 0, 0)
    small.forward(torch.arange(3), 1, 0)
    small.reset([0])
    assert [small.row_length(r) for r in range(2)] == [0, 3]
    with pytest.raises(KVRangeError):
        small.forward(torch.arange(1), 0, 4)
    small.reset()
    assert [small.row_length(r) for r in range(3)] == [0, 0, 0]


@torch.inference_mode()
def test_inputs_of_the_wrong_kind_for_the_stage_are_refused(checkpoint, full_weights, small):
    with pytest.raises(ValueError, match="int64 token ids"):
        small.forward(torch.zeros(3, 576), 0, 0)
    cfg = checkpoint.config
    mid = StageModel(cfg, (2, 4), False, False, 1, 16, weights=full_weights.select((2, 4), False, False))
    with pytest.raises(ValueError, match="hidden states"):
        mid.forward(torch.arange(3), 0, 0)
    assert mid.forward(torch.randn(3, 576), 0, 0).shape == (3, 576)


@torch.inference_mode()
def test_a_ragged_step_equals_each_segment_run_alone(full_stage, prompts):
    """A decode, a 4-token verify and a 7-token prefill chunk in one step op give, byte for byte, what each
    gives alone (batch-invariant kernels), in any table order."""
    from ringshm.transport.messages import WANT_ALL, WANT_LAST, WANT_LOGITS, WANT_NONE

    gen = torch.Generator().manual_seed(0)
    vocab = full_stage.config.vocab
    rows, lens = [0, 2, 3], [1, 4, 7]
    wants = [WANT_LAST | WANT_LOGITS, WANT_ALL, WANT_NONE]
    chunks = [torch.randint(0, vocab, (n,), generator=gen) for n in lens]
    starts, alone = [len(prompts[0]), len(prompts[1]), 0], []
    for i, row in enumerate(rows):
        if starts[i]:
            full_stage.forward(prompts[i], row, 0)
        alone.append(full_stage.step(chunks[i], [(row, starts[i], lens[i], wants[i])]))
    order = [2, 0, 1]  # overwrite the same positions as one op, rows listed out of order on purpose
    out = full_stage.step(torch.cat([chunks[i] for i in order]),
                          [(rows[i], starts[i], lens[i], wants[i]) for i in order])
    assert out.token_ids.shape == (1 + 4,) and out.logits.shape == (1, vocab)
    assert torch.equal(out.token_ids, torch.cat([alone[0].token_ids, alone[1].token_ids]))
    assert torch.equal(out.logits, alone[0].logits)  # byte for byte
    assert alone[2].token_ids.numel() == 0 and alone[2].logits is None
    assert [full_stage.row_length(r) for r in rows] == [s + n for s, n in zip(starts, lens)]


@torch.inference_mode()
def test_a_ragged_step_through_split_stages_equals_one_stage(full_stage, full_weights, prompts):
    from ringshm.transport.messages import WANT_ALL, WANT_LAST, WANT_LOGITS

    stages = _stages(full_stage.config, full_weights, [0, 12, 30], max_rows=2)
    for r in (0, 1):
        full_stage.forward(prompts[r], r, 0)
        run_stages(stages, prompts[r], r, 0)
    table = [(0, len(prompts[0]), 1, WANT_LAST | WANT_LOGITS), (1, len(prompts[1]), 3, WANT_ALL | WANT_LOGITS)]
    x = torch.tensor([17, 42, 43, 44])
    one = full_stage.step(x, table)
    h = stages[0].step(x, table)
    assert h.shape == (4, 576)
    two = stages[1].step(h, table)
    assert torch.equal(one.logits, two.logits) and torch.equal(one.token_ids, two.token_ids)
    assert one.token_ids.shape == (4,) and one.logits.shape == (2, full_stage.config.vocab)


@torch.inference_mode()
def test_a_bf16_stage_agrees_with_fp32_on_the_next_token(checkpoint, prompts, full_stage):
    bf = StageModel.from_path(checkpoint.path, max_rows=1, max_seq_len=128, dtype=torch.bfloat16,
                              checkpoint=checkpoint)
    assert bf.layers[0].wqkv.dtype == torch.bfloat16 and bf.kv[0].k.dtype == torch.float32
    ref = full_stage.forward(prompts[0], 0, 0, return_logits=True)
    out = bf.forward(prompts[0], 0, 0, return_logits=True)
    assert out.logits.dtype == torch.float32
    assert torch.equal(out.token_ids, ref.token_ids)
    assert (out.logits - ref.logits).abs().max().item() < 1.0  # bf16 weights: a loose bound


@torch.inference_mode()
def test_reserved_scratch_is_held_from_the_start_and_changes_no_bit(checkpoint, full_weights, small):
    """``reserve`` sizes the layers' scratch for the largest op up front (the stage calls it with its op budget),
    so an op up to that size runs in it without growing it, and the bits are those of a stage that grew it."""
    from ringshm.model.layer import layer_scratch_bytes

    cfg = checkpoint.config
    fresh = StageModel(cfg, (0, 2), True, True, max_rows=3, max_seq_len=16,
                       weights=full_weights.select((0, 2), True, True))
    fresh.reserve(12)
    held = fresh._work.data_ptr()
    assert fresh._work.numel() * 4 == layer_scratch_bytes(cfg, 12) > layer_scratch_bytes(cfg, 11)
    ids = torch.arange(100, 112)
    out = fresh.forward(ids, 0, 0, all_positions=True, return_logits=True)
    assert fresh._work.data_ptr() == held  # no growth for an op within the reserve
    ref = small.forward(ids, 0, 0, all_positions=True, return_logits=True)
    assert torch.equal(out.token_ids, ref.token_ids) and torch.equal(out.logits, ref.logits)
