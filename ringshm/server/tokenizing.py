"""The server's tokenisation: off the event loop, cheap checks first, and one client's big input never queued in
front of everyone else's small ones.

    request ─▶ cheap checks (counts, characters) ─▶ small lane (one thread, the engine's tokenizer)   ≤ 16 KiB chars
                                                 └▶ large lane (one thread, a tokenizer of its own)  > 16 KiB chars

- **Cheap checks first.** Before a character is tokenised, a request whose prompt cannot fit is refused from its
  length alone: a token covers at most ``max_token_chars`` characters (the longest piece of the vocabulary), so a
  text longer than ``margin x max_token_chars x max_model_len`` holds more tokens than the context
  (``max_prompt_chars``). A prompt given as token ids is refused from its count.
- **Two lanes.** Tokenising is linear in the text (a 1.9 MB prompt takes ~1.4 s on one core here), and one thread
  served every request in arrival order: six such prompts held every new request's admission for seconds. Inputs
  over ``SMALL_CHARS`` characters go to their own thread with their own tokenizer instance (an HF tokenizer must
  not be used from two threads at once); the Rust tokenizer releases the GIL while it works, so the small lane
  and the event loop go on meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
SMALL_CHARS = 16 * 1024  # inputs longer than this (characters, or ids of an id prompt) take the large lane


def max_prompt_chars(tokenizer, max_seq_len: int) -> int:
    """The most characters a prompt of at most ``max_seq_len`` tokens can have.

    A token's text is at most the length of its vocabulary piece (byte-level BPE: one character per byte, and a
    text character is at least one byte; SentencePiece: "▁" for a space). A normalizer may shorten the text before
    it is split (Unicode composition: at most 3 characters into 1), hence a margin of 4 when there is one.
    """
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    margin = 1 if backend is not None and backend.normalizer is None else 4
    return margin * longest * max_seq_len


class Tokenizers:
    """The two tokenisation lanes of one server (module docstring) over the engine's tokenizer.

    Args:
        engine: the ``Engine`` (its ``tokenizer`` and ``model_path``; a checkpoint without a tokenizer has no
            text lanes: text prompts are refused by the engine's own check).
        max_seq_len: positions one request may reach (the server's ``max_model_len``).
    """

    def __init__(self, engine, max_seq_len: int):
        self.engine, self.max_seq_len = engine, max_seq_len
        self._small = ThreadPoolExecutor(1, thread_name_prefix="ringshm-tokenize")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="ringshm-tokenize-large")
        self._large_tokenizer = None  # loaded on the large lane at its first use
        self._max_chars: int | None = None
        self._lock = threading.Lock()

    def max_chars(self) -> int:
        """``max_prompt_chars`` of the engine's tokenizer (computed once, ~10 ms for a 49k vocabulary)."""
        with self._lock:
            if self._max_chars is None:
                self._max_chars = max_prompt_chars(self.engine.tokenizer, self.max_seq_len)
            return self._max_chars

    def too_long(self, n_chars: int) -> str | None:
        """Why a text of ``n_chars`` characters cannot be a prompt (None when it may be one)."""
        limit = self.max_chars()
        if n_chars <= limit:
            return None
        return (f"the prompt has {n_chars} characters, more than the {limit} that this model's context of "
                f"{self.max_seq_len} tokens can hold: shorten it")

    async def run(self, size: int, fn: Callable[..., T]) -> T:
        """``fn(tokenizer)`` on the lane ``size`` (characters or ids of the input) picks, without blocking the
        event loop."""
        large = size > SMALL_CHARS
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._large if large else self._small, self._call, large, fn)

    def _call(self, large: bool, fn: Callable[..., T]) -> T:
        if not large:
            return fn(self.engine.tokenizer)
        if self._large_tokenizer is None:
            from ringshm.model.tokenizer import load_tokenizer

            self._large_tokenizer = load_tokenizer(self.engine.model_path)
        return fn(self._large_tokenizer)

    def shutdown(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
