"""A stream that ends with ops in flight is skipped by the stages (issue 26, finding 2): a stage does not compute a
segment whose row the coordinator marked ended, writes no KV for it, forwards it marked ``SKIPPED`` (so a later
stage, another host's too, skips it without reading a mark), and the other segments of the op get the bytes they
get alone. In process, on the default model split in two stages."""

from __future__ import annotations

import pytest
import torch

from ringshm.engine.logprobs import split_reply
from ringshm.model.attention import table_len
from ringshm.model.stage_model import StageModel
from ringshm.runtime.stage import apply, mark_ended
from ringshm.transport import messages as m

N = 12  # tokens per segment


@pytest.fixture(scope="module")
def stages(model_path, checkpoint):
    half = checkpoint.config.n_layers // 2
    return [StageModel.from_path(model_path, r, max_rows=2, max_seq_len=64, checkpoint=checkpoint)
            for r in [(0, half), (half, checkpoint.config.n_layers)]]


def _op(stages, segments: list[m.Segment], ids: list[torch.Tensor], targets: torch.Tensor | None) -> m.Message:
    b = stages[0].block_size
    tables = torch.cat([stages[0].row_table(s.row)[:table_len(s.start + s.n_tokens, b)] for s in segments])
    tensors = [torch.cat(ids)] + ([targets] if targets is not None else []) + [tables.to(torch.int32)]
    return m.Message(m.STEP, segments=segments, tensors=tensors)


def _wire(msg: m.Message) -> m.Message:
    return m.decode(memoryview(m.encode(msg)))


def _filled(stage: StageModel, row: int) -> int:
    return int(stage.fill[stage.row_table(row).long()].sum())


def test_a_marked_row_is_skipped_at_every_stage_and_its_batch_mate_keeps_its_solo_bytes(stages):
    a_ids = torch.arange(100, 100 + N)
    b_ids = torch.arange(300, 300 + N)
    keep = m.Segment(0, 0, N, m.WANT_LAST | m.WANT_LOGPROBS | m.want_k(3))
    ended_seg = m.Segment(1, 0, N, m.WANT_LAST | m.WANT_PROMPT_LOGPROBS | m.want_k(2))
    targets = torch.arange(301, 301 + N - 1)  # the ended segment's prompt logprob targets: dropped with it
    for s in stages:
        s.reset()
    solo = apply(stages[1], _wire(apply(stages[0], _op(stages, [keep], [a_ids], None), False)), True)

    for s in stages:
        s.reset()
    ended = bytearray(2)
    ended[1] = 1
    op = _op(stages, [keep, ended_seg], [a_ids, b_ids], targets)
    fwd = apply(stages[0], _wire(op), False, ended=ended)
    assert fwd.segments == [keep, m.Segment(1, 0, N, m.SKIPPED)]
    assert len(fwd.tensors) == 2, "the skipped segment's target ids must not travel on"
    assert torch.count_nonzero(fwd.tensors[0][N:]) == 0
    assert _filled(stages[0], 1) == 0 and _filled(stages[0], 0) == N, "stage 0 wrote KV for the ended row"

    reply = apply(stages[1], _wire(fwd), True, ended=None)  # no mark here: the table says skip
    assert _filled(stages[1], 1) == 0 and _filled(stages[1], 0) == N, "stage 1 wrote KV for the skipped segment"
    assert m.same_table(op.segments, reply.segments)
    assert [t.tolist() for t in reply.tensors] == [t.tolist() for t in solo.tensors]
    got = split_reply(_wire(reply))
    assert got[1].ids == [] and got[1].logprobs == [] and got[0].ids == split_reply(_wire(solo))[0].ids


def test_an_op_of_ended_rows_only_computes_nothing(stages):
    for s in stages:
        s.reset()
    seg = m.Segment(0, 0, N, m.WANT_LAST)
    fwd = apply(stages[0], _wire(_op(stages, [seg], [torch.arange(5, 5 + N)], None)), False, ended=b"\x01\x00")
    reply = apply(stages[1], _wire(fwd), True)
    assert reply.segments == [m.Segment(0, 0, N, m.SKIPPED)] and reply.tensors[0].numel() == 0
    assert _filled(stages[0], 0) == _filled(stages[1], 0) == 0


def test_marks_are_read_only_for_rows_in_range_and_only_a_skip_may_differ_in_a_reply_table():
    segs = [m.Segment(0, 0, 4, m.WANT_LAST), m.Segment(7, 0, 4, m.WANT_LAST), m.Segment(-1, 0, 4, m.WANT_LAST)]
    assert mark_ended(segs, b"\x01\x01") == [m.Segment(0, 0, 4, m.SKIPPED)] + segs[1:]  # rows 7, -1: no mark
    assert mark_ended(segs, None) is segs
    sent = [m.Segment(0, 0, 4, m.WANT_LAST), m.Segment(1, 4, 1, m.WANT_LAST)]
    assert m.same_table(sent, [sent[0], m.Segment(1, 4, 1, m.SKIPPED)])
    assert not m.same_table(sent, [sent[0], m.Segment(1, 5, 1, m.SKIPPED)])  # another position
    assert not m.same_table(sent, [sent[0], m.Segment(1, 4, 1, m.WANT_ALL)])  # another ask
    assert not m.same_table(sent, [sent[0], m.Segment(1, 4, 1, m.SKIPPED | m.WANT_LAST)])
    assert not m.same_table(sent, sent[:1])


def test_a_skipped_segment_that_cannot_be_a_segment_is_refused(stages):
    bad = m.Message(m.STEP, segments=[m.Segment(0, 0, 0, m.SKIPPED)],
                    tensors=[torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)])
    with pytest.raises(ValueError, match="n_tokens >= 1"):
        apply(stages[0], bad, False)
    short = _op(stages, [m.Segment(0, 0, N, m.WANT_LAST)], [torch.arange(N)], None)
    short.tensors[-1] = short.tensors[-1][:0]
    with pytest.raises(ValueError, match="block tables must be int32"):
        apply(stages[0], short, False, ended=b"\x01")


class _EndsAfter:
    """Marks for 2 rows that read "not ended" for the first ``reads`` looks at row 0, then "ended" (a client that
    leaves while a stage computes its op)."""

    def __init__(self, reads: int):
        self.left = reads

    def __len__(self) -> int:
        return 2

    def __getitem__(self, row: int) -> int:
        if row != 0:
            return 0
        self.left -= 1
        return int(self.left < 0)


def test_an_op_whose_stream_ends_mid_op_stops_at_the_next_layer_and_goes_on_skipped(stages):
    for s in stages:
        s.reset()
    seg = m.Segment(0, 0, N, m.WANT_LAST)
    ends = _EndsAfter(reads=3)  # read by mark_ended, before layers 0 and 1: "running"; before layer 2: "ended"
    fwd = apply(stages[0], _wire(_op(stages, [seg], [torch.arange(5, 5 + N)], None)), False, ended=ends)
    assert ends.left == -2, "the op did not stop at the first layer after its stream ended"  # + mark_ended's read
    assert fwd.segments == [m.Segment(0, 0, N, m.SKIPPED)]
    assert torch.count_nonzero(fwd.tensors[0]) == 0 and _filled(stages[0], 0) == 0
    # a row that never ends: the op runs whole, as without marks
    full = apply(stages[0], _wire(_op(stages, [seg], [torch.arange(5, 5 + N)], None)), False, ended=bytearray(2))
    assert full.segments == [seg] and _filled(stages[0], 0) == N


def test_a_skipped_constrained_segment_takes_no_mask_row_and_its_batch_mate_reads_its_own(stages):
    """Bitmasks travel behind their op (a MASKS record, ``WANT_ALLOWED``): the op a stage forwards carries none; the
    last stage reads the rows of the segments it computes by the record's own table, so the ended segment first in
    the table (skipped, its ``want`` cleared) does not shift the kept segment's row (a reader that counted rows by
    the skipped table would take the ended one's allow-all row, and not say 7)."""
    a_ids, b_ids = torch.arange(300, 300 + N), torch.arange(100, 100 + N)
    width = -(-stages[0].config.vocab // 32)
    allow = torch.zeros(2, width, dtype=torch.int32)
    allow[0, :] = -1  # the ended one anything
    allow[1, 0] = 1 << 7  # the kept segment may only say token 7
    ended_seg = m.Segment(1, 0, N, m.WANT_LAST | m.WANT_ALLOWED)
    keep = m.Segment(0, 0, N, m.WANT_LAST | m.WANT_ALLOWED)
    for s in stages:
        s.reset()
    ended = bytearray(2)
    ended[1] = 1
    op = _op(stages, [ended_seg, keep], [a_ids, b_ids], None)
    masks = _wire(m.masks_record(op, allow))
    fwd = apply(stages[0], _wire(op), False, ended=ended)
    assert fwd.segments == [m.Segment(1, 0, N, m.SKIPPED), keep]
    assert len(fwd.tensors) == 2, "a forwarded op carries no bitmasks: they follow it"
    fwd = _wire(fwd)
    reply = apply(stages[1], fwd, True, masks=lambda kept: m.mask_rows(masks, fwd, kept))
    assert split_reply(reply)[1].ids == [7]
    free_op = _op(stages, [m.Segment(0, 0, N, m.WANT_LAST)], [b_ids], None)
    free = apply(stages[1], _wire(apply(stages[0], _wire(free_op), False)), True)
    assert split_reply(free)[0].ids != [7], "token 7 is the mask's doing, not the model's own argmax"
    with pytest.raises(ValueError, match="no MASKS record"):
        apply(stages[1], fwd, True)
    other = m.Message(m.MASKS, seq=fwd.seq + 1, segments=fwd.segments, tensors=[allow])
    with pytest.raises(m.ProtocolError, match="wants its MASKS record"):
        m.mask_rows(other, fwd, [1])
