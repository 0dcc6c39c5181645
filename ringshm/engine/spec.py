"""Lossless speculative decoding: the prompt-lookup (n-gram) drafter, the greedy accept rule, and the
field's metrics.

Drafter (prompt lookup decoding, Saxena 2023; the n-gram idea of Yang et al. 2023, "Inference with
Reference"): take the longest suffix of the stream's tokens (prompt + output), n from ``ngram_max`` down to
``ngram_min``, that also occurs earlier, and propose the up to ``k`` tokens that followed its latest earlier
occurrence. No match: no proposal (the stream then takes a plain decode step).

Accept rule (greedy, lossless): a verify segment feeds ``[current, d1 .. dK]`` at the stream's position; the last
stage returns the argmax ``a0 .. aK`` at every position, ``a_i`` being the model's next token after
``current, d1 .. d_i``. The accepted drafts are the longest prefix with ``d_{i+1} == a_i``; the committed
tokens are ``a_0 .. a_m`` (m accepted drafts plus the model's own token after them: the correction at the
first mismatch, or the bonus token after a full accept). Every committed token is the model's argmax given
committed tokens only, so the output equals plain greedy decoding (up to float ties where a verify matmul's
shape rounds differently from a decode's).
"""

from __future__ import annotations

from dataclasses import dataclass


class NGramDrafter:
    """Prompt-lookup drafter over one stream's committed tokens, with an incremental n-gram index.

    Args:
        k: most draft tokens per proposal (>= 1).
        ngram_max, ngram_min: suffix lengths tried, longest first (1 <= ngram_min <= ngram_max).

    Raises:
        ValueError: k < 1 or bad n-gram sizes.
    """

    def __init__(self, k: int = 4, ngram_max: int = 3, ngram_min: int = 1):
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"spec_k must be an int >= 1, got {k!r}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.k, self.ngram_max, self.ngram_min = k, ngram_max, ngram_min
        self.tokens: list[int] = []
        # n-gram -> (previous end, latest end) of its occurrences; ends are exclusive indices into tokens
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}

    def extend(self, tokens) -> None:
        """Append committed tokens and index every n-gram that ends at each of them."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                key = tuple(self.tokens[end - n : end])
                self._ends[key] = (self._ends.get(key, (-1, -1))[1], end)

    def propose(self, tail: list[int] = ()) -> list[int]:
        """Up to ``k`` draft tokens to follow the committed tokens plus ``tail`` (tokens already drafted but
        not yet verified); [] when no suffix occurs earlier."""
        ctx = self.tokens + list(tail) if tail else self.tokens
        for n in range(min(self.ngram_max, len(ctx)), self.ngram_min - 1, -1):
            prev, last = self._ends.get(tuple(ctx[-n:]), (-1, -1))
            end = last if last < len(ctx) else prev  # the latest occurrence that is not the suffix itself
            if end >= n:
                return ctx[end : end + self.k]
        return []


def accept(drafts: list[int], argmax_ids: list[int]) -> list[int]:
    """Tokens to commit after a verify segment: ``argmax_ids[:m + 1]`` with m the accepted drafts (see module).

    ``argmax_ids`` has ``len(drafts) + 1`` entries (one per fed token).

    Raises:
        ValueError: the lengths disagree.
    """
    if len(argmax_ids) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} argmax ids, got {len(argmax_ids)}")
    m = 0
    while m < len(drafts) and drafts[m] == argmax_ids[m]:
        m += 1
    return [int(t) for t in argmax_ids[: m + 1]]


@dataclass
class SpecStats:
    """Speculation counters of one request (or summed over many).

    ``draft_tokens``: drafts proposed and sent; ``accepted_tokens``: drafts that matched; ``verify_steps``:
    verify segments whose reply was used (stale ones excluded). ``acceptance_rate`` = accepted / drafted;
    ``mean_accepted_length`` = tokens committed per verify step (accepted drafts + the model's own token).
    """

    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    committed_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_tokens / self.verify_steps if self.verify_steps else 0.0

    def add(self, other: "SpecStats") -> None:
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.verify_steps += other.verify_steps
        self.committed_tokens += other.committed_tokens
