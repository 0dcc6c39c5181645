"""Choosing the next token (greedy, or temperature / top-k / top-p with a seed) and turning tokens into text
incrementally with stop strings. Coordinator-side only; no rings here.
"""

from __future__ import annotations

import math

import torch

NUCLEUS_CANDIDATES = 1024  # top-p looks for the nucleus among the most likely this many first (no full sort)


def non_finite() -> FloatingPointError:
    """The error that ends a stream whose greedy choice came back ``ringshm.model.head.NON_FINITE`` (its logit NaN
    or inf: the weights are likely broken); the stream fails alone, as a sampled one does on such logits."""
    return FloatingPointError("the model's logit at its greedy choice is NaN or inf at this position: its weights "
                              "are likely broken (NaN or inf)")


def greedy_id(argmax_id: int) -> int:
    """The stage's greedy choice as a token id.

    Raises:
        FloatingPointError: the last stage said its logit was NaN or inf (``non_finite``).
    """
    if argmax_id < 0:
        raise non_finite()
    return int(argmax_id)


class Sampler:
    """Next-token rule of one request.

    The last position's logits (fp32 ``[vocab]``) are processed in this fixed order (vLLM's):

        1. penalties, over the stream's history: ``repetition_penalty`` r for every token seen in the prompt or
           the output (logit / r when the logit is > 0, logit * r otherwise: CTRL, Keskar et al. 2019; vLLM /
           HF), then ``frequency_penalty * count + presence_penalty * (count > 0)`` subtracted, ``count`` being
           the token's occurrences in the output so far (OpenAI's rule);
        2. ``logit_bias``: each listed token's bias added (OpenAI: -100 bans, +100 forces in practice);
        3. ``min_tokens``: ``eos_ids`` set to -inf while fewer than ``min_tokens`` tokens were generated;
           a structured output's grammar: every token it does not allow set to -inf (``allowed``);
        4. greedy (``temperature == 0``): the argmax of the processed logits. Otherwise divided by
           ``temperature``, cut to the ``top_k`` most likely (0: no cut) and to the smallest set whose
           probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019), then sampled with a
           ``torch.Generator`` seeded by ``seed`` — the same seed gives the same tokens.

    A greedy request with no control set (``needs_logits`` False) takes the last stage's argmax as is, and no
    logits cross the ring. All of this is per stream, over batch-invariant logits: a stream's tokens do not
    depend on its batch-mates.

    Every value is one fp32 can carry (``ringshm.generation_params``: a temperature in (0, 1e-2) samples at 1e-2, the
    repetition penalty lies in [1e-2, 1e2]), and the nucleus always keeps the most likely token (HF's
    ``min_tokens_to_keep``), so a tiny ``top_p`` is greedy-like instead of an empty set.

    Raises:
        ValueError: temperature outside [0, 100], top_k < 0, top_p outside (0, 1], a penalty out of range,
            min_tokens < 0, a logit_bias that is not ``{id >= 0: bias in [-100, 100]}``.
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None, *,
                 logit_bias: dict[int, float] | None = None, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, min_tokens: int = 0,
                 eos_ids=()):
        from ringshm.generation_params import check_logit_bias, check_repetition_penalty, check_temperature

        temperature = check_temperature(temperature)
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no cut), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        check_repetition_penalty(repetition_penalty)
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

    def __call__(self, argmax_id: int, logits: torch.Tensor | None, prompt=(), output=(),
                 allowed: torch.Tensor | None = None) -> int:
        """The next token: ``argmax_id`` when greedy with nothing to process (a constrained stream's is already
        the argmax among allowed tokens: the last stage applied its mask), else the rule of the class docstring
        over ``logits`` (fp32 ``[vocab]``), the stream's ``prompt`` + ``output`` ids so far and ``allowed`` (bool
        ``[vocab]``, the grammar's tokens; None: all).

        Raises:
            ValueError: logits are needed (``needs_logits``) and ``logits`` is None.
            FloatingPointError: the logits hold NaN or inf (weights with NaN: the checkpoint is broken); greedy:
                the argmax's logit is NaN or inf (``greedy_id``).
        """
        if not self.needs_logits:
            return greedy_id(argmax_id)
        if logits is None:
            raise ValueError("sampling, logit_bias, penalties and min_tokens need the last position's logits "
                             "(WANT_LOGITS)")
        if not math.isfinite(float(logits.sum())):  # one NaN or inf makes the sum so (10 us, not 250)
            raise FloatingPointError(f"the model's logits hold {int((~torch.isfinite(logits)).sum())} NaN / inf "
                                     f"values at this position: its weights are likely broken (NaN or inf)")
        scores = self.process(logits, prompt, output) if self.processes else logits.float()
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        if self.greedy:
            return int(torch.argmax(scores))
        scores = scores / self.temperature
        if self.top_k and self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1.0:
            scores = self._nucleus(scores)
        # Inverse-CDF draw: one uniform from the request's generator (torch.multinomial over a 49k vocabulary
        # takes ~2 ms on one core, this ~0.1 ms); a token of probability 0 is never drawn.
        cdf = torch.cumsum(torch.softmax(scores, dim=-1), dim=0)  # [V]
        if not 0.5 < float(cdf[-1]) < 1.5:  # NaN included: never a token drawn from a broken distribution
            raise FloatingPointError(f"the sampling distribution is not one (its mass is {float(cdf[-1])}): "
                                     f"temperature {self.temperature}, top_p {self.top_p}")
        u = torch.rand((), generator=self.generator) * cdf[-1]
        return min(int(torch.searchsorted(cdf, u, right=True)), scores.numel() - 1)

    def _nucleus(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` ([V], fp32) with every token outside the nucleus at -inf: a token is dropped when the tokens
        strictly more likely already reach ``top_p``; the most likely always stays (a top_p of 1e-300 is 0 in
        fp32, where every token would reach it). The nucleus is looked for among the ``NUCLEUS_CANDIDATES`` most
        likely first (``topk``), and in the whole sorted vocabulary only when they do not reach ``top_p``."""
        n = scores.numel()
        k = min(NUCLEUS_CANDIDATES, n)
        values, order = torch.topk(scores, k)  # sorted, most likely first
        probs = torch.exp(values - torch.logsumexp(scores, dim=0))
        before = torch.cumsum(probs, dim=0) - probs  # mass of the tokens more likely than each
        if k < n and float(before[-1] + probs[-1]) < self.top_p:
            values, order = torch.sort(scores, descending=True)
            probs = torch.exp(values - torch.logsumexp(scores, dim=0))
            before = torch.cumsum(probs, dim=0) - probs
        keep = before < self.top_p
        keep[0] = True
        out = torch.full_like(scores, float("-inf"))
        out[order[keep]] = scores[order[keep]]
        return out


class StopMatcher:
    """Aho-Corasick automaton over a request's stop strings (Aho & Corasick 1975), fed the output text one
    character at a time: O(1) amortised work per character whatever the number and length of the strings.

    ``feed(ch)`` returns the length of the longest stop string that ends at this character (0: none), so a match
    is found at the first character where any stop string ends (the earliest end; of several ending there, the
    longest). ``held`` is the length of the longest suffix of the text fed so far that is a proper prefix of some
    stop string: the text that may still grow into one, and must be held back.
    """

    def __init__(self, stops):
        goto: list[dict[str, int]] = [{}]
        ends = [0]  # length of the stop string ending exactly at a node (0: none)
        depth = [0]
        for word in stops:
            node = 0
            for ch in word:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = goto[node][ch] = len(goto)
                    goto.append({})
                    ends.append(0)
                    depth.append(depth[node] + 1)
                node = nxt
            ends[node] = len(word)
        fail = [0] * len(goto)
        out = ends[:]  # longest stop string ending at a node or at a node on its failure chain
        hold = [d if goto[n] else 0 for n, d in enumerate(depth)]  # deepest proper prefix on the chain
        queue = list(goto[0].values())
        for node in queue:  # breadth first: a node's failure link is shallower, so already final
            for ch, child in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(ch, 0)  # node is not the root here, so this is shallower than child
                out[child] = max(out[child], out[fail[child]])
                if not goto[child]:
                    hold[child] = hold[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._out, self._hold = goto, fail, out, hold
        self.state = 0

    def feed(self, ch: str) -> int:
        goto, fail, node = self._goto, self._fail, self.state
        while node and ch not in goto[node]:
            node = fail[node]
        self.state = node = goto[node].get(ch, 0)
        return self._out[node]

    @property
    def held(self) -> int:
        return self._hold[self.state]


class TextStream:
    """Incremental detokenisation with stop strings.

    ``push(token_id)`` returns the new text that is safe to show: text that could still be the start of a
    stop string, or an incomplete UTF-8 sequence, is held back until it resolves. ``stopped`` becomes True
    once a stop string appears; the text then ends just before the first one to end (OpenAI's rule; of several
    ending at one character, before the longest). With ``min_tokens``, stop strings are not looked for until more
    than ``min_tokens`` tokens were pushed, and a stop string must then end past the text of those first tokens
    (vLLM's rule: ``min_tokens`` holds back stop strings too).

    The work is linear in the text: each push decodes only a short window, the tokens since ``prefix_offset``
    (a few tokens of context before the ones not yet turned into text; the window's text minus its context's
    text is the new text: vLLM's incremental detokenisation, the context keeps BPE merges and leading spaces
    right at the seam; a window ending in U+FFFD waits for more bytes), and each new character goes once
    through the stop strings' automaton (``StopMatcher``). A request's stop strings are capped
    (``ringshm.generation_params.check_stop``), so one stream's text work stays small beside the others' on the thread
    that serves them all.
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
        self._matcher = StopMatcher(self.stop) if self.stop else None
        self._fed = 0  # characters of decoded fed to the matcher

    def _window(self, final: bool = False) -> None:
        """Move newly decodable text into ``decoded`` (all of it when ``final``)."""
        ids = self.token_ids
        new = self.tokenizer.decode(ids[self.prefix_offset :], skip_special_tokens=True)
        old = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        if len(new) > len(old) and (final or not new.endswith("\ufffd")):
            self.decoded += new[len(old) :]
            self.prefix_offset, self.read_offset = max(self.read_offset - 4, 0), len(ids)

    def _emit(self) -> str:
        """Feed the new characters of ``decoded`` to the matcher; return the text now safe to show (up to a stop
        string that ends past ``no_stop_before``, or up to what may still grow into one)."""
        full = self.decoded
        matcher = self._matcher
        if matcher is None:
            safe = len(full)
        else:
            while self._fed < len(full):
                length = matcher.feed(full[self._fed])
                self._fed += 1
                if length and self._fed > self.no_stop_before:
                    self.stopped = True
                    safe = max(self._fed - length, len(self.text))
                    break
            else:
                safe = max(len(full) - matcher.held, len(self.text))
        delta, self.text = full[len(self.text) : safe], full[:safe]
        return delta

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.token_ids.append(int(token_id))
        if self.tokenizer is None:
            return ""
        self._window()
        if len(self.token_ids) <= self.min_tokens:
            self.no_stop_before = len(self.decoded)
        return self._emit()

    def finish(self) -> str:
        """Flush what was held back (the stream ended without completing a stop string)."""
        if self.stopped or self.tokenizer is None:
            return ""
        self._window(final=True)
        if self._matcher is not None:
            delta = self._emit()
            if self.stopped:
                return delta
            self._matcher = None  # nothing more can grow into a stop string
            return delta + self._emit()
        return self._emit()
