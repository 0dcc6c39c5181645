"""What the last stage returns for a step op: which positions reach the LM head (``plan_head``), and the argmax
ids, logits and logprobs built from their logits (``head_outputs``). ``StageModel`` and the tests' fake stage
share it, so both answer a segment table the same way (the reply layout is in ``ringshm.transport.messages``).

Logprobs are the fp32 log-softmax of a position's fp32 logits (``logprob_rows``), the same function the
coordinator applies to the logits of a sampled stream, so a token's logprob has the same bits whichever side
computed it. Each row is reduced on its own (torch's last-dim log-softmax and top-k walk one row at a time,
whatever the row count or the thread count; ``tests/test_logprobs.py`` checks the bits), so a request's
logprobs do not depend on its batch-mates or on how its prompt was chunked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ringshm.transport.messages import WANT_ALL, WANT_ALLOWED, WANT_LAST, WANT_LOGITS, WANT_LOGPROBS, Segment

NON_FINITE = -1  # a token id that says: the greedy choice's logit is NaN or inf (``head_outputs``)


@dataclass
class StageOutput:
    """What the last stage returns for one op (``ringshm.transport.messages``' reply layout).

    ``token_ids``: int64 argmax ids ``[Σ outputs]`` (``step``; ``[n]`` or ``[1]`` from ``forward``);
    ``NON_FINITE`` (-1) where the greedy choice's logit is NaN or inf (broken weights: no token to choose).
    ``logits``: fp32 last-position logits ``[n_logit_segments, vocab]`` (``forward``: ``[vocab]``), only when
    asked for. ``lp_chosen`` fp32 ``[P]``, ``lp_top_ids`` int64 ``[Σ k]``, ``lp_top`` fp32 ``[Σ k]``: the
    logprobs of the positions that asked for them (None when none did).
    """

    token_ids: torch.Tensor
    logits: torch.Tensor | None = None
    lp_chosen: torch.Tensor | None = None
    lp_top_ids: torch.Tensor | None = None
    lp_top: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The reply's tensors in wire order (CPU, contiguous): ids, then logits and the three logprob
        tensors when present."""
        out = [self.token_ids.cpu().contiguous()]
        if self.logits is not None:
            out.append(self.logits.float().cpu().contiguous())
        if self.lp_chosen is not None:
            out += [t.cpu().contiguous() for t in (self.lp_chosen, self.lp_top_ids, self.lp_top)]
        return out


class HeadPlan(NamedTuple):
    """Where the head runs for one op and what each of those positions gives back.

    ``positions``: rows of the op's ``[T, hidden]`` the head runs on. The other lists index into them:
    ``out_rows`` (argmax ids, table order), ``logit_rows`` (logits returned), ``lp_rows`` (logprobs returned,
    reply order) with ``lp_ids`` (the id scored there: a target, or -1 for the row's own argmax) and ``lp_k``
    (its top-k count), ``allowed_rows`` (outputs whose argmax is restricted, in the order of ``allowed``'s rows).
    ``allowed``: int32 ``[len(allowed_rows), ceil(vocab / 32)]`` token bitmasks, a callable that returns them when
    the logits are ready (the last stage's MASKS record, read from its ring only then), or None. ``width``: the
    rows' int32 words, ``ceil(vocab / 32)``.
    """

    positions: list[int]
    out_rows: list[int]
    logit_rows: list[int]
    lp_rows: list[int]
    lp_ids: list[int]
    lp_k: list[int]
    allowed_rows: list[int]
    allowed: torch.Tensor | Callable[[], torch.Tensor] | None = None
    width: int = -1


def plan_head(segments: Sequence[Segment], targets: Sequence[int] = (),
              allowed: torch.Tensor | Callable[[], torch.Tensor] | None = None, vocab: int | None = None) -> HeadPlan:
    """The ``HeadPlan`` of a checked segment table, its ``targets`` (int ids, ``Σ n_targets`` of them) and its
    ``allowed`` bitmasks (int32 ``[Σ n_allowed_rows, ceil(vocab / 32)]``, or a callable returning them, checked when
    ``head_outputs`` calls it; None when no segment has ``WANT_ALLOWED``; ``vocab``: the model's vocabulary, which
    fixes the row width).

    Raises:
        ValueError: ``targets`` does not hold one id per target position, or ``allowed`` one row of
            ``ceil(vocab / 32)`` int32 words per masked output.
    """
    segs = [s if isinstance(s, Segment) else Segment(*s) for s in segments]
    need = sum(s.n_targets() for s in segs)
    if len(targets) != need:
        raise ValueError(f"the segments score {need} target ids, the op carries {len(targets)}")
    n_masked = sum(s.n_allowed_rows() for s in segs)
    width = -(-vocab // 32) if vocab is not None else -1
    if (n_masked or allowed is not None) and not callable(allowed):
        _check_allowed(allowed, n_masked, width)
    plan = HeadPlan([], [], [], [], [], [], [], allowed if n_masked else None, width)
    o = ti = 0
    for s in segs:
        n_t = s.n_targets()
        for i in range(n_t):  # a prompt position, scored against the next prompt id
            plan.lp_rows.append(len(plan.positions))
            plan.lp_ids.append(int(targets[ti + i]))
            plan.lp_k.append(s.k)
            plan.positions.append(o + i)
        ti += n_t
        outs = range(o, o + s.n_tokens) if s.want & WANT_ALL else [o + s.n_tokens - 1] if s.want & WANT_LAST else ()
        for p in outs:
            row = len(plan.positions)
            plan.positions.append(p)
            plan.out_rows.append(row)
            if s.want & WANT_ALLOWED:
                plan.allowed_rows.append(row)
            if s.want & WANT_LOGPROBS:
                plan.lp_rows.append(row)
                plan.lp_ids.append(-1)
                plan.lp_k.append(s.k)
        if s.want & WANT_LOGITS and outs:
            plan.logit_rows.append(len(plan.positions) - 1)
        o += s.n_tokens
    return plan


def _check_allowed(allowed: torch.Tensor | None, n_masked: int, width: int) -> None:
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.int32 or tuple(allowed.shape) != (n_masked,
                                                                                                        width):
        got = (f"{allowed.dtype} {tuple(allowed.shape)}" if isinstance(allowed, torch.Tensor)
               else type(allowed).__name__)
        raise ValueError(f"the segments restrict {n_masked} outputs: the op's allowed-token bitmasks must be "
                         f"int32 [{n_masked}, {width}], got {got}")


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool ``[n, vocab]`` from int32 bitmask rows ``[n, ceil(vocab / 32)]``: token t is allowed iff bit t % 32
    of word t // 32 is set (llguidance's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def argmax_rows(logits: torch.Tensor, words: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
    """Each row's argmax (int64 ``[n]``) of ``logits`` (``[n, vocab]``), over the tokens bitmask ``words`` (int32
    ``[n, ceil(vocab / 32)]``, ``unpack_bitmask``'s layout) allows, or every token: the smallest index of the
    largest allowed value, ties and NaN as ``masked_fill(~allowed, -inf).argmax()`` (csrc/kernels.h
    ``ringshm_argmax_rows``: one C pass for the value, one for its first index; a row reads only itself). CPU fp32
    runs the kernel (49k tokens, measured: 41 us a row, 44 with a mask, against 102 us for torch's argmax, and
    ~300 us more for a mask taken through a top-k); elsewhere (CUDA) torch's masked argmax. A row that allows no
    token is a caller's bug: -1 there (CPU). ``isa``: for tests, one ``RINGSHM_ISA_*`` path (-1: the CPU's best).

    Raises:
        ValueError: a shape or dtype other than the above.
    """
    if logits.dim() != 2 or (words is not None and (words.dtype != torch.int32 or words.dim() != 2 or
                                                   words.shape[0] != logits.shape[0])):
        raise ValueError(f"argmax_rows takes logits [n, vocab] and int32 words [n, W], got {tuple(logits.shape)} and "
                         f"{None if words is None else (words.dtype, tuple(words.shape))}")
    n, vocab = logits.shape
    if not logits.is_cpu or logits.dtype != torch.float32 or n == 0:
        if words is None:
            return logits.argmax(dim=-1)
        return logits.masked_fill(~unpack_bitmask(words.to(logits.device), vocab), float("-inf")).argmax(dim=-1)
    from ringshm._C import ffi, lib
    from ringshm.errors import check_status

    logits = logits.contiguous()
    out = torch.empty(n, dtype=torch.int64)
    wptr = ffi.NULL
    if words is not None:
        words = words.contiguous()
        wptr = ffi.cast("const int32_t *", words.data_ptr())
    check_status(lib.ringshm_argmax_rows(ffi.cast("int64_t *", out.data_ptr()), ffi.cast("const float *",
                 logits.data_ptr()), wptr, n, vocab, 0 if words is None else words.shape[1], isa), "argmax_rows")
    return out


def head_outputs(logits: torch.Tensor, plan: HeadPlan) -> StageOutput:
    """The ``StageOutput`` of ``plan`` from the logits at its positions, ``[len(plan.positions), vocab]``.

    An output in ``plan.allowed_rows`` takes its argmax over the tokens its bitmask allows (the others are
    -inf for the choice only: logits and logprobs returned stay the model's). Row by row, so a row's choice
    does not depend on the op's other rows. A callable ``plan.allowed`` is called here, once, after the logits.

    Raises:
        ValueError: the bitmasks are not int32 ``[len(plan.allowed_rows), plan.width]``; whatever a callable
            ``plan.allowed`` raises (the last stage: a MASKS record that did not come, or not this op's)."""
    if not plan.positions:
        return StageOutput(torch.zeros(0, dtype=torch.int64))
    words = None
    if plan.allowed_rows:  # every row's mask: the plan's where given, all tokens elsewhere
        allowed = plan.allowed
        if callable(allowed):  # late masks (the last stage's MASKS record): read only now
            allowed = allowed()
            _check_allowed(allowed, len(plan.allowed_rows), plan.width)
        if len(plan.allowed_rows) == logits.shape[0]:  # every position restricted (rows in position order)
            words = allowed.cpu()
        else:
            words = torch.full((logits.shape[0], allowed.shape[1]), -1, dtype=torch.int32)
            words[plan.allowed_rows] = allowed.cpu()
    argmax = argmax_rows(logits, words)  # [n_pos]
    # argmax takes a NaN first, then +inf: a choice whose logit is not finite is no token (the coordinator fails
    # that stream alone, as sampling fails on such logits), never an id the model did not choose
    # (a row whose mask allows no token has no argmax, -1 already: the grammar refuses such a mask before it)
    chosen = logits.gather(1, argmax.clamp(min=0)[:, None])[:, 0]
    ids = torch.where(torch.isfinite(chosen) & (argmax >= 0), argmax, NON_FINITE)
    out = StageOutput(ids[plan.out_rows] if plan.out_rows else torch.zeros(0, dtype=torch.int64),
                      logits[plan.logit_rows].float() if plan.logit_rows else None)
    if plan.lp_rows:
        rows = torch.tensor(plan.lp_rows, dtype=torch.int64, device=logits.device)
        chosen = torch.tensor(plan.lp_ids, dtype=torch.int64, device=logits.device)
        chosen = torch.where(chosen >= 0, chosen, argmax[rows])
        out.lp_chosen, out.lp_top_ids, out.lp_top = logprob_rows(logits[rows], chosen, plan.lp_k)
    return out


def logprob_rows(logits: torch.Tensor, chosen: torch.Tensor, ks: Sequence[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of each row of ``logits`` (``[P, vocab]``, computed in fp32): the logprob of ``chosen``
    (int64 ``[P]``) and the ``ks[i]`` most likely ids of row i with their logprobs, most likely first.

    Returns ``(chosen_lp fp32 [P], top_ids int64 [Σ ks], top_lp fp32 [Σ ks])``. Each row's bits depend only
    on that row (module docstring).

    Raises:
        ValueError: ``chosen`` or ``ks`` not one per row, or a k outside [0, vocab].
    """
    p, vocab = logits.shape
    if chosen.shape != (p,) or len(ks) != p or any(not 0 <= k <= vocab for k in ks):
        raise ValueError(f"need one chosen id and one k in [0, {vocab}] per row of {p}, got {tuple(chosen.shape)} "
                         f"and {list(ks)[:8]}")
    lp = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0]  # [P]
    ids, vals, a = [], [], 0
    while a < p:  # rows of equal k together (a segment's rows), one top-k call each
        b = a
        while b < p and ks[b] == ks[a]:
            b += 1
        if ks[a]:
            top = torch.topk(lp[a:b], ks[a], dim=-1)  # sorted, most likely first
            vals.append(top.values.reshape(-1))
            ids.append(top.indices.reshape(-1))
        a = b
    top_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=logits.device)
    top_lp = torch.cat(vals) if vals else torch.zeros(0, dtype=torch.float32, device=logits.device)
    return chosen_lp.contiguous(), top_ids.contiguous(), top_lp.contiguous()
