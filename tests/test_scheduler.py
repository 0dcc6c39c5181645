"""Solo, batch and rows coordinators over the fake oracle ring (issue 5): lossless as an exact equality, the
shared pipelined prefill, reply checks, cancellation and continuous batching. Runs in seconds."""

from __future__ import annotations

import random

import pytest
import torch

from fake_stage import EOS, OracleModel, RecordingModel, make_stream, start_fake_ring
from ringshm.coordinator import decode_solo, prefill
from ringshm.errors import ReplyMismatch, StageError
from ringshm import messages as m
from ringshm.scheduler import RowsRun, run_batch

CHUNK = 4


def scripts(n: int, length: int = 60, seed: int = 0) -> list[list[int]]:
    """``n`` token sequences with distinct first tokens and no EOS (ids 10..999)."""
    rng = random.Random(seed)
    return [[100 + i] + [rng.randrange(10, 1000) for _ in range(length - 1)] for i in range(n)]


@pytest.fixture
def fake():
    rings = []

    def start(model, **kw):
        rings.append(start_fake_ring(model, **kw))
        return rings[-1]

    yield start
    for r in rings:
        r.close()


def run_solo(ring, s):
    events = list(prefill(ring.link, [s], CHUNK, 8)) + list(decode_solo(ring.link, s))
    return events


def run_mode(ring, mode, streams, depth, max_rows=8, decode_depth=1):
    if mode == "rows":
        return list(RowsRun(ring.link, streams, max_rows, CHUNK, depth))
    for i, s in enumerate(streams):
        s.row = i
    return list(run_batch(ring.link, streams, CHUNK, depth, decode_depth))


@pytest.mark.parametrize("mode", ["rows", "batch"])
@pytest.mark.parametrize("depth", [1, 3, 8, 64])
def test_every_stream_gets_exactly_its_scripted_continuation(fake, mode, depth):
    ts = scripts(4)
    ring = fake(OracleModel(ts, max_rows=4))
    prompt_lens = [3, 9, 17, 4]  # 1, 3, 5 and 1 chunks: different lengths, some shorter than the window
    streams = [make_stream(i, t, n, 12) for i, (t, n) in enumerate(zip(ts, prompt_lens))]
    events = run_mode(ring, mode, streams, depth)
    for s, t, n in zip(streams, ts, prompt_lens):
        assert s.tokens == t[n : n + 12]
        assert s.finish_reason == "length"
    assert len(events) == 48 and ring.link.in_flight == 0


@pytest.mark.parametrize("mode", ["rows", "batch"])
def test_depth_1_and_depth_8_give_identical_tokens_and_the_same_per_row_frame_order(fake, mode):
    ts = scripts(3, seed=1)
    got = {}
    for depth in (1, 8):
        model = RecordingModel(ts, max_rows=3)
        ring = fake(model)
        streams = [make_stream(i, t, 5 + 6 * i, 6) for i, t in enumerate(ts)]
        run_mode(ring, mode, streams, depth)
        per_row = {}
        for f in model.frames:
            if f[0] == "one":
                per_row.setdefault(f[1], []).append(f[2:])
        got[depth] = ([s.tokens for s in streams], per_row)
    assert got[1][0] == got[8][0]
    assert got[1][1] == got[8][1]  # each row sees the same ops in the same order


def test_one_stream_in_rows_mode_puts_exactly_the_solo_frames_on_the_wire(fake):
    (t,) = scripts(1, seed=2)
    solo_model, rows_model = RecordingModel([t], 2), RecordingModel([t], 2)
    solo = make_stream(0, t, 10, 8, row=0)
    run_solo(fake(solo_model), solo)
    rows = make_stream(0, t, 10, 8)
    run_mode(fake(rows_model), "rows", [rows], depth=8)
    assert solo.tokens == rows.tokens == t[10:18]
    assert solo_model.frames == rows_model.frames


def test_a_stream_whose_prefill_yields_eos_finishes_at_its_first_token(fake):
    ts = scripts(2, seed=3)
    ts[0][7] = EOS  # the token after a 7-token prompt
    ring = fake(OracleModel(ts, max_rows=2))
    streams = [make_stream(0, ts[0], 7, 10), make_stream(1, ts[1], 7, 10)]
    run_mode(ring, "rows", streams, depth=8)
    assert streams[0].tokens == [EOS] and streams[0].finish_reason == "stop"
    assert streams[1].tokens == ts[1][7:17]


def test_eos_mid_decode_ends_only_that_stream_in_batch_mode(fake):
    ts = scripts(3, seed=4)
    ts[1][12] = EOS
    ring = fake(OracleModel(ts, max_rows=3))
    streams = [make_stream(i, t, 8, 10) for i, t in enumerate(ts)]
    run_mode(ring, "batch", streams, depth=8)
    assert streams[1].tokens == ts[1][8:13] and streams[1].finish_reason == "stop"
    assert streams[0].tokens == ts[0][8:18] and streams[2].tokens == ts[2][8:18]


@pytest.mark.parametrize("mode", ["rows", "batch"])
def test_max_new_tokens_1_ends_each_stream_at_its_prefill(fake, mode):
    ts = scripts(3, seed=5)
    ring = fake(RecordingModel(ts, max_rows=3))
    streams = [make_stream(i, t, 6, 1) for i, t in enumerate(ts)]
    run_mode(ring, mode, streams, depth=8)
    assert [s.tokens for s in streams] == [[t[6]] for t in ts]
    # only the prefill chunks went out (2 per 6-token prompt), no decode op
    assert ring.model.frames == [("one", r, start, n) for r in range(3) for start, n in ((0, 4), (4, 2))]
    assert ring.link.in_flight == 0


def test_batch_decode_depth_2_micro_batches_give_the_same_tokens(fake):
    ts = scripts(5, seed=6)
    ring = fake(OracleModel(ts, max_rows=5))
    streams = [make_stream(i, t, 5 + i, 9) for i, t in enumerate(ts)]
    run_mode(ring, "batch", streams, depth=8, decode_depth=2)
    assert [s.tokens for s in streams] == [t[5 + i : 14 + i] for i, t in enumerate(ts)]


def test_more_streams_than_rows_queue_and_reuse_freed_rows(fake):
    ts = scripts(7, seed=7)
    ring = fake(RecordingModel(ts, max_rows=2))
    streams = [make_stream(i, t, 3 + i, 4 + i) for i, t in enumerate(ts)]
    run_mode(ring, "rows", streams, depth=8, max_rows=2)
    assert [s.tokens for s in streams] == [t[3 + i : 7 + 2 * i] for i, t in enumerate(ts)]
    assert {f[1] for f in ring.model.frames if f[0] == "one"} == {0, 1}


def test_cancelling_one_stream_leaves_the_others_exact(fake):
    ts = scripts(3, seed=8)
    ring = fake(OracleModel(ts, max_rows=3))
    streams = [make_stream(i, t, 6, 20) for i, t in enumerate(ts)]
    run = RowsRun(ring.link, streams, 3, CHUNK, 8)
    for n, ev in enumerate(run):
        if n == 6:
            run.cancel(1)
    assert streams[1].finish_reason == "cancelled" and len(streams[1].tokens) < 20
    assert streams[1].tokens == ts[1][6 : 6 + len(streams[1].tokens)]
    assert streams[0].tokens == ts[0][6:26] and streams[2].tokens == ts[2][6:26]
    assert ring.link.in_flight == 0


def test_a_cancelled_stream_frees_its_row_for_a_waiting_one(fake):
    ts = scripts(3, seed=9)
    ring = fake(OracleModel(ts, max_rows=1))
    streams = [make_stream(i, t, 5, 30) for i, t in enumerate(ts)]
    run = RowsRun(ring.link, streams, 1, CHUNK, 8)
    for ev in run:
        if ev.stream == 0 and len(streams[0].tokens) == 3:
            run.cancel(0)
        if ev.stream == 1 and len(streams[1].tokens) == 2:
            run.cancel(1)
    assert [s.finish_reason for s in streams] == ["cancelled", "cancelled", "length"]
    assert streams[2].tokens == ts[2][5:35]


def test_swapped_replies_raise_reply_mismatch_instead_of_being_misassigned(fake):
    ts = scripts(2, seed=10)
    ring = fake(OracleModel(ts, max_rows=2), swap_at=2)
    streams = [make_stream(i, t, 9, 5) for i, t in enumerate(ts)]
    with pytest.raises(ReplyMismatch, match="expected the reply to seq 1"):
        run_mode(ring, "rows", streams, depth=8)


def test_an_op_reading_kv_never_written_comes_back_as_a_stage_error(fake):
    (t,) = scripts(1, seed=11)
    ring = fake(OracleModel([t], max_rows=1))
    s = make_stream(0, t, 5, 3, row=0)
    ring.link.send(m.Message(m.PREFILL, row=0, start=3, n_tokens=2, rows=[(0, 3)],
                             tensors=[torch.tensor(t[3:5])]))
    with pytest.raises(StageError, match="never written"):
        ring.link.recv()
    assert run_solo(ring, s) and s.tokens == t[5:8]  # the ring is still usable


def test_reset_clears_a_row_so_an_op_continuing_it_reads_kv_never_written(fake):
    (t,) = scripts(1, seed=12)
    ring = fake(OracleModel([t], max_rows=2))
    s = make_stream(0, t, 6, 2, row=0)
    run_solo(ring, s)
    ring.link.send(m.Message(m.RESET, rows=[(0, 0)]))
    reply, _ = ring.link.recv()
    assert reply.op == m.RESET and reply.is_reply
    ring.link.send(m.Message(m.PREFILL, row=0, start=6, n_tokens=1, rows=[(0, 6)], tensors=[torch.tensor(t[6:7])]))
    with pytest.raises(StageError, match="never written"):
        ring.link.recv()
