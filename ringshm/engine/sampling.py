"""Choosing the next token (greedy, or temperature / top-k / top-p with a seed) and turning tokens into text
incrementally with stop strings. Coordinator-side only; no rings here.
"""

from __future__ import annotations

import torch


class Sampler:
    """Next-token rule of one request.

    The last position's logits (fp32 ``[vocab]``) are processed in this fixed order (vLLM's):

        1. penalties, over the stream's history: ``repetition_penalty`` r for every token seen in the prompt or
           the output (logit / r when the logit is > 0, logit * r otherwise: CTRL, Keskar et al. 2019; vLLM /
           HF), then ``frequency_penalty * count + presence_penalty * (count > 0)`` subtracted, ``count`` being
           the token's occurrences in the output so far (OpenAI's rule);
        2. ``logit_bias``: each listed token's bias added (OpenAI: -100 bans, +100 forces in practice);
        3. ``min_tokens``: ``eos_ids`` set to -inf while fewer than ``min_tokens`` tokens were generated;
        4. greedy (``temperature == 0``): the argmax of the processed logits. Otherwise divided by
           ``temperature``, cut to the ``top_k`` most likely (0: no cut) and to the smallest set whose
           probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019), then sampled with a
           ``torch.Generator`` seeded by ``seed`` — the same seed gives the same tokens.

    A greedy request with no control set (``needs_logits`` False) takes the last stage's argmax as is, and no
    logits cross the ring. All of this is per stream, over batch-invariant logits: a stream's tokens do not
    depend on its batch-mates.

    Raises:
        ValueError: temperature < 0, top_k < 0, top_p outside (0, 1], a penalty out of range, min_tokens < 0, a
            logit_bias that is not ``{id >= 0: bias in [-100, 100]}``.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, *,
                 logit_bias: dict[int, float] | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_tokens: int = 0,
                 eos_ids=()):
        from ringshm.config import check_logit_bias

        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no cut), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        if not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {repetition_penalty}")
        if min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {min_tokens}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.logit_bias = check_logit_bias(logit_bias) or {}
        self.presence_penalty, self.frequency_penalty = float(presence_penalty), float(frequency_penalty)
        self.repetition_penalty, self.min_tokens = float(repetition_penalty), int(min_tokens)
        self.eos_ids = sorted(set(int(t) for t in eos_ids))
        self._bias_ids = torch.tensor(list(self.logit_bias), dtype=torch.int64)
        self._bias = torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)
        self.generator = None
        if not self.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(seed if seed is not None else torch.seed())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes(self) -> bool:
        """Whether logits are processed (steps 1-3) before the choice."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 or (
            self.repetition_penalty != 1 or (self.min_tokens > 0 and bool(self.eos_ids)))

    @property
    def needs_logits(self) -> bool:
        """Whether the last stage must send this stream's logits (``WANT_LOGITS``): it samples, or it
        processes them."""
        return not self.greedy or self.processes

    def process(self, logits: torch.Tensor, prompt=(), output=()) -> torch.Tensor:
        """Steps 1-3 of the class docstring: fp32 ``[vocab]`` logits after penalties, logit_bias and the
        min_tokens mask, given the stream's ``prompt`` and ``output`` token ids so far."""
        scores = logits.float().clone()  # [V]
        vocab = scores.numel()
        if self.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool)
            history = [t for t in (*prompt, *output) if 0 <= t < vocab]
            if history:
                seen[torch.tensor(history, dtype=torch.int64)] = True
            r = self.repetition_penalty
            scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
        if (self.presence_penalty or self.frequency_penalty) and output:
            counts = torch.bincount(torch.tensor([t for t in output if 0 <= t < vocab], dtype=torch.int64),
                                    minlength=vocab)[:vocab].float()  # [V]
            scores = scores - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()
        if self.logit_bias:
            keep = self._bias_ids < vocab
            scores.index_add_(0, self._bias_ids[keep], self._bias[keep])
        if len(output) < self.min_tokens:
            eos = [t for t in self.eos_ids if t < vocab]
            if eos:
                scores[torch.tensor(eos, dtype=torch.int64)] = float("-inf")
        return scores

    def __call__(self, argmax_id: int, logits: torch.Tensor | None, prompt=(), output=()) -> int:
        """The next token: ``argmax_id`` when greedy with nothing to process, else the rule of the class
        docstring over ``logits`` (fp32 ``[vocab]``) and the stream's ``prompt`` + ``output`` ids so far.

        Raises:
            ValueError: logits are needed (``needs_logits``) and ``logits`` is None.
        """
        if not self.needs_logits:
            return int(argmax_id)
        if logits is None:
            raise ValueError("sampling, logit_bias, penalties and min_tokens need the last position's logits "
                             "(WANT_LOGITS)")
        scores = self.process(logits, prompt, output) if self.processes else logits.float()
        if self.greedy:
            return int(torch.argmax(scores))
        scores = scores / self.temperature
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
    once a stop string appears; the text then ends just before it (OpenAI's rule). With ``min_tokens``, stop
    strings are not looked for until more than ``min_tokens`` tokens were pushed, and a stop string must then
    end past the text of those first tokens (vLLM's rule: ``min_tokens`` holds back stop strings too).

    Each push decodes only a short window: the tokens since ``prefix_offset`` (a few tokens of context
    before the ones not yet turned into text), so a request costs O(n) decoding, not O(n^2). The window's
    text minus its context's text is the new text (vLLM's incremental detokenisation; the context keeps
    BPE merges and leading spaces right at the seam). A window ending in U+FFFD waits for more bytes.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.no_stop_before = 0  # a stop string must end past this many characters (the min_tokens text)
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
        if len(self.token_ids) <= self.min_tokens:
            self.no_stop_before = len(full)
        for s in self.stop if len(self.token_ids) > self.min_tokens else ():
            at = full.find(s, max(0, len(self.text) - len(s), self.no_stop_before - len(s) + 1))
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
