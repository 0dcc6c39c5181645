"""The coordinator's side of one step op (``StepTag``: what each of its segments is) and the commit of one answered
segment (``commit_segment``): its prompt logprobs, its next token (sampled, under the stream's grammar) or its
verified drafts, their text, and the KV positions the reply made final. ``ringshm.engine.scheduler`` builds the
ops, keeps the windows of ops in flight and frees rows; what a reply means to one stream is here."""

from __future__ import annotations

from dataclasses import dataclass, field

from ringshm.engine.coordinator import Stream, TokenEvent
from ringshm.engine.kv_blocks import KVBlocks
from ringshm.engine.logprobs import cut, sampled_logprob
from ringshm.engine.spec_decode import VerifyTag
from ringshm.transport import messages as m

PREFILL, DECODE, VERIFY = 0, 1, 2  # what a segment is to the coordinator (the stage only sees the table)


@dataclass(eq=False)
class StepTag:
    """The coordinator's side of one step op: per segment its stream, kind (``PREFILL`` / ``DECODE`` /
    ``VERIFY``) and, for a verify segment, its ``VerifyTag``; built while the op is assembled, then sent as
    the tag of the op in flight."""

    streams: list[Stream] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    verifies: list[VerifyTag | None] = field(default_factory=list)
    n_long_tokens: int = 0  # tokens of long prompts' chunks sent while streams decoded (``PrefillBudget``)
    loaded: bool = False  # long-prompt tokens were in flight or aboard at its send (``PrefillBudget``)
    t_sent: float = 0.0  # perf_counter() at its send (``PrefillBudget``)

    @property
    def decode(self) -> bool:
        """The op counts against the decode window (it carries a decode or verify segment)."""
        return any(k != PREFILL for k in self.kinds)

    @property
    def prefill(self) -> bool:
        """The op counts against the prefill window (it carries a prefill chunk)."""
        return PREFILL in self.kinds

    def add(self, s: Stream, kind: int, verify: VerifyTag | None = None) -> None:
        self.streams.append(s)
        self.kinds.append(kind)
        self.verifies.append(verify)


def commit_segment(s: Stream, seg: m.Segment, kind: int, v: VerifyTag | None, part, events: list[TokenEvent],
                   cache: KVBlocks | None) -> Exception | None:
    """Commit one answered segment of ``s``: its prompt logprobs, its next token(s) and their text (appended to
    ``events``), its KV (``commit_kv``; ``cache`` None: the prefix cache is off).

    ``part``: the segment's slice of the reply (``ringshm.engine.logprobs.split_reply``). Raises whatever the
    stream's own work raises (its sampler, grammar, detokeniser, stop strings); the scheduler ends that stream
    alone, its events of this segment dropped. Returns the error that ends it after the events appended (a verify
    whose accepted tokens came before a NaN / inf choice: ``SpecDecoder.on_reply``), else None."""
    lps = part.logprobs
    if seg.n_targets():  # a prompt chunk's scores of the prompt's next ids
        s.prompt_token_logprobs += [cut(lp, s.prompt[seg.start + i + 1], s.prompt_logprobs)
                                    for i, lp in enumerate(lps[:seg.n_targets()])]
        lps = lps[seg.n_targets():]
    if kind == VERIFY:
        new, failure = s.spec.on_reply(part.ids, v)
        events.extend(new)
        if failure is not None:
            return failure
    elif part.ids and not s.done:  # a decode, or a prompt's last chunk: the next token
        allowed = s.grammar.allowed() if s.grammar is not None and s.sampler.needs_logits else None
        token = s.sampler(part.ids[-1], part.logits, s.prompt, s.tokens, allowed)
        lp = None
        if s.logprobs is not None:  # the stage's (argmax taken as is), or from the logits sampled from
            lp = cut(lps[-1], token, s.logprobs) if lps else sampled_logprob(part.logits, token, s.logprobs)
            s.token_logprobs.append(lp)
        events.append(TokenEvent(s.index, token, s.commit(token), lp))
    if cache is not None:
        commit_kv(s, seg, cache)
    return None


def commit_kv(s: Stream, seg: m.Segment, cache: KVBlocks) -> None:
    """The positions an answered segment wrote from final tokens are final: the prompt's, a decode's input, a
    verify's input and accepted drafts (at most one short of the stream's tokens: the newest is fed next).
    Full blocks of final positions enter the prefix cache."""
    if s not in cache or s.skip_marked:  # a stage may have skipped its KV since it was marked ended
        return
    final = min(seg.start + seg.n_tokens, len(s.prompt) + len(s.tokens) - 1 if s.tokens else len(s.prompt))
    if final > cache.kv_valid(s):
        cache.commit(s, _Tokens(s.prompt, s.tokens), final)


class _Tokens:
    """A stream's prompt followed by its generated tokens, sliced without building the concatenation (the
    prefix cache reads one block of it per commit)."""

    def __init__(self, prompt: list[int], tokens: list[int]):
        self.prompt, self.tokens = prompt, tokens

    def __len__(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def __getitem__(self, sl: slice) -> list[int]:
        n = len(self.prompt)
        if sl.stop <= n:
            return self.prompt[sl]
        if sl.start >= n:
            return self.tokens[sl.start - n:sl.stop - n]
        return self.prompt[sl.start:] + self.tokens[:sl.stop - n]
