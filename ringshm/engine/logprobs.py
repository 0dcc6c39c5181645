"""Logprobs on the coordinator's side: ``TokenLogprob`` (one token's logprob and its position's top-k), a step
reply split per segment (``split_reply``), and the logprobs of a sampled token from the logits it was sampled
from (``sampled_logprob``).

Which side computes a token's logprob: a greedy stream that takes the stage's argmax as is asks the last stage
(``WANT_LOGPROBS``: only the chosen logprob and the top-k cross the ring); a stream that samples or processes
its logits already gets the full fp32 logits (``WANT_LOGITS``) and computes them here with the same function
(``ringshm.model.head.logprob_rows``). Either way they are the log-softmax of the raw model logits, before
temperature, penalties and logit_bias: vLLM's default (``logprobs_mode="raw_logprobs"``; its v1 sampler:
"Use the original logits (before any penalties or temperature scaling) for the top-k logprobs").
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringshm.errors import ReplyMismatch
from ringshm.model.head import logprob_rows
from ringshm.transport import messages as m


class TokenLogprob(NamedTuple):
    """One token's logprob (natural log, fp32 widened to a Python float) and the ``top`` ``(id, logprob)``
    pairs of its position, most likely first (k of them; the token itself may or may not be among them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class SegmentReply(NamedTuple):
    """What a step reply carries for one segment: argmax ``ids``, the ``logits`` row (fp32 ``[vocab]``) of a
    ``WANT_LOGITS`` segment, and per logprob position ``(logprob, top)`` in reply order (targets first)."""

    ids: list[int]
    logits: torch.Tensor | None
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]]


def split_reply(reply: m.Message) -> list[SegmentReply]:
    """Split a step reply's tensors (``ringshm.transport.messages``' reply layout) per segment, in table order.

    Raises:
        ReplyMismatch: the tensors do not hold what the segment table asks for.
    """
    segs = reply.segments
    n_out = sum(s.n_outputs() for s in segs)
    n_logits = sum(1 for s in segs if s.want & m.WANT_LOGITS and s.n_outputs())
    ks = [s.k for s in segs for _ in range(s.n_logprob_positions())]
    want = [(n_out,)]  # the ids tensor is always there, empty when nothing is asked
    if n_logits:
        want.append((n_logits, None))
    if ks:
        want += [(len(ks),), (sum(ks),), (sum(ks),)]
    got = [tuple(t.shape) for t in reply.tensors]
    if len(got) != len(want) or any(len(g) != len(w) or any(a is not None and a != b for a, b in zip(w, g))
                                    for g, w in zip(got, want)):
        raise ReplyMismatch(f"seq {reply.seq}: the segment table asks for {n_out} ids, {n_logits} logit rows and "
                            f"{len(ks)} logprob positions ({sum(ks)} top entries); the reply's tensors are {got}")
    ids = reply.tensors[0].tolist()
    logits = reply.tensors[1] if n_logits else None
    chosen, top_ids, top_lp = ((t.tolist() for t in reply.tensors[-3:]) if ks else ([], [], []))
    out, pos, li, lp, ti = [], 0, 0, 0, 0
    for s in segs:
        n, n_lp = s.n_outputs(), s.n_logprob_positions()
        row = None
        if s.want & m.WANT_LOGITS and n:
            row, li = logits[li], li + 1
        lps = []
        for i in range(n_lp):
            lps.append((chosen[lp + i], tuple(zip(top_ids[ti: ti + s.k], top_lp[ti: ti + s.k]))))
            ti += s.k
        out.append(SegmentReply(ids[pos: pos + n], row, lps))
        pos, lp = pos + n, lp + n_lp
    return out


def sampled_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The ``TokenLogprob`` of ``token`` under the raw fp32 ``logits`` ``[vocab]`` it was chosen from, with the
    ``k`` most likely tokens (``ringshm.model.head.logprob_rows``: the bits the last stage would compute)."""
    chosen, ids, vals = logprob_rows(logits[None], torch.tensor([token], dtype=torch.int64), [k])
    return TokenLogprob(token, chosen.item(), tuple(zip(ids.tolist(), vals.tolist())))


def cut(lp: tuple[float, tuple[tuple[int, float], ...]], token: int, k: int) -> TokenLogprob:
    """A ``TokenLogprob`` for ``token`` from a reply's ``(logprob, top)``, its top list cut to ``k`` (a
    segment carries the larger k when a prompt's last chunk serves both kinds)."""
    return TokenLogprob(token, lp[0], lp[1][:k])
