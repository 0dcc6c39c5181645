"""Choosing the next token (greedy, or temperature / top-k / top-p with a seed) and turning tokens into text
incrementally with stop strings. Coordinator-side only; no rings here.
"""

from __future__ import annotations

import torch


class Sampler:
    """Next-token rule of one request.

    ``temperature == 0`` is greedy: the last stage's argmax is taken as is (no logits cross the ring).
    Otherwise logits are divided by ``temperature``, cut to the ``top_k`` most likely (0: no cut) and to the
    smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019), then sampled
    with a ``torch.Generator`` seeded by ``seed`` — the same seed gives the same tokens.

    Raises:
        ValueError: temperature < 0, top_k < 0, or top_p outside (0, 1].
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no cut), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(seed if seed is not None else torch.seed())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __call__(self, argmax_id: int, logits: torch.Tensor | None) -> int:
        """The next token: ``argmax_id`` when greedy, else a draw from ``logits`` (fp32 ``[vocab]``)."""
        if self.greedy:
            return int(argmax_id)
        if logits is None:
            raise ValueError("sampling needs the last position's logits (WANT_LOGITS)")
        scores = logits.float() / self.temperature
        if self.top_k and self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # drop a token when the tokens strictly more likely already reach top_p
            drop = (torch.cumsum(probs, dim=-1) - probs) >= self.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


class TextStream:
    """Incremental detokenisation with stop strings.

    ``push(token_id)`` returns the new text that is safe to show: text that could still be the start of a
    stop string, or an incomplete UTF-8 sequence, is held back until it resolves. ``stopped`` becomes True
    once a stop string appears; the text then ends just before it (OpenAI's rule).

    Each push decodes only a short window: the tokens since ``prefix_offset`` (a few tokens of context
    before the ones not yet turned into text), so a request costs O(n) decoding, not O(n^2). The window's
    text minus its context's text is the new text (vLLM's incremental detokenisation; the context keeps
    BPE merges and leading spaces right at the seam). A window ending in U+FFFD waits for more bytes.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.decoded = ""  # text of token_ids[:read_offset]
        self.prefix_offset = 0  # first token of the decoding window
        self.read_offset = 0  # tokens already turned into text
        self.text = ""  # text emitted so far (a prefix of decoded)
        self.stopped = False

    def _window(self, final: bool = False) -> None:
        """Move newly decodable text into ``decoded`` (all of it when ``final``)."""
        ids = self.token_ids
        new = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        old = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        if len(new) > len(old) and (final or not new.endswith("\ufffd")):
            self.decoded += new[len(old) :]
            self.prefix_offset, self.read_offset = max(self.read_offset - 4, 0), len(ids)

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(int(token_id))
        if self.tokenizer is None:
            return ""
        self._window()
        full = self.decoded
        for s in self.stop:
            at = full.find(s, max(0, len(self.text) - len(s)))
            if at >= 0:
                self.stopped = True
                at = max(at, len(self.text))
                delta, self.text = full[len(self.text) : at], full[:at]
                return delta
        safe = len(full)
        for s in self.stop:  # hold back a suffix that may grow into a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        safe = max(safe, len(self.text))
        delta, self.text = full[len(self.text) : safe], full[:safe]
        return delta

    def finish(self) -> str:
        """Flush what was held back (the stream ended without completing a stop string)."""
        if self.stopped or self.tokenizer is None:
            return ""
        self._window(final=True)
        delta, self.text = self.decoded[len(self.text) :], self.decoded
        return delta
