"""How many tokens of long prompts may be in flight while streams decode: chunked prefill interleaved with
decodes, the budget steered by the decodes' own round trips so that a long prompt slows each decoding stream by
a bounded factor (``ringshm.engine.scheduler`` applies it).

Every stage applies ops in arrival order, so a decode waits for whatever prefill went out before it. With
``stall_ratio`` r the budget is steered so that a decode's round trip (the coordinator's send of the op carrying
it to the reply) while long prompts are in flight stays about r times its round trip without them — Sarathi-Serve's
stall-free batching (Agrawal et al., OSDI 2024), with the token budget found by feedback rather than fixed:

- ``t_quiet_s``: an exponential average of the round trips of decode-bearing ops sent with no long-prompt token in
  flight or aboard;
- ``t_loaded_s``: the same for the ops sent with some;
- after each loaded reply the budget grows by ``GROW`` while ``t_loaded_s <= r * t_quiet_s`` and shrinks by
  ``SHRINK`` otherwise (multiplicative steps, as a congestion window), within ``[min_tokens, max_tokens]``.

Round trips are measured whatever else is in flight, because that is what a decoding stream waits. Until a quiet
round trip is known the budget stays where it is (it starts at ``min_tokens``). The chunking never changes a byte
(every stream's bits are the same whatever the chunking), only when tokens arrive.
"""

from __future__ import annotations

import time

MIN_TOKENS = 16  # a long prompt advances at least this many tokens per round trip, however fast decodes are
EWMA_WEIGHT = 0.2  # the newest round trip's weight in each average
GROW, SHRINK = 1.25, 0.8  # the budget's step after a loaded reply under / over the target


class PrefillBudget:
    """The tokens of long prompts that may be in flight while streams decode (module docstring).

    Args:
        stall_ratio: the target round trip of a decode with long prompts in flight over one without (> 1).
        max_tokens: the most tokens the budget reaches (the engine's ``max_step_tokens`` x ``prefill_depth``).
        min_tokens: the least (at most ``max_tokens``).

    Raises:
        ValueError: ``stall_ratio <= 1`` or a token bound < 1.
    """

    def __init__(self, stall_ratio: float, max_tokens: int, min_tokens: int = MIN_TOKENS):
        if not stall_ratio > 1:
            raise ValueError(f"stall_ratio must be > 1, got {stall_ratio!r}")
        if max_tokens < 1 or min_tokens < 1:
            raise ValueError(f"token bounds must be >= 1, got min {min_tokens}, max {max_tokens}")
        self.stall_ratio, self.max_tokens, self.min_tokens = stall_ratio, max_tokens, min(min_tokens, max_tokens)
        self.budget = float(self.min_tokens)
        self.t_quiet_s: float | None = None
        self.t_loaded_s: float | None = None

    def tokens(self) -> int:
        """Tokens of long prompts the ops in flight may carry while streams decode."""
        return int(self.budget)

    @staticmethod
    def on_send(tag, loaded: bool) -> None:
        """Note an op just sent: ``tag`` (its ``StepTag``); ``loaded``: long-prompt tokens in flight or aboard."""
        tag.t_sent, tag.loaded = time.perf_counter(), loaded

    def on_reply(self, tag) -> None:
        """Note ``tag``'s reply (call as it arrives, before its tokens are committed); only decode-bearing ops
        count: their round trip is what a decoding stream waits."""
        if not tag.decode:
            return
        rtt = time.perf_counter() - tag.t_sent
        if not tag.loaded:
            self.t_quiet_s = _ewma(self.t_quiet_s, rtt)
            return
        self.t_loaded_s = _ewma(self.t_loaded_s, rtt)
        if self.t_quiet_s is None:
            return
        step = GROW if self.t_loaded_s <= self.stall_ratio * self.t_quiet_s else SHRINK
        self.budget = max(self.min_tokens, min(self.max_tokens, self.budget * step))


def _ewma(avg: float | None, x: float) -> float:
    return x if avg is None else (1 - EWMA_WEIGHT) * avg + EWMA_WEIGHT * x
