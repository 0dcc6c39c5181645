"""An in-process reference of what a pipeline of stage processes computes: the same ops, in the same order,
through consecutive ``StageModel``s handing hidden states over as tensors (no processes, no rings). The tests
compare the engine and the split stages against it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ringshm.model.stage_model import StageModel, StageOutput


def run_stages(stages: Sequence[StageModel], x: torch.Tensor, row: int, start: int, *,
               all_positions: bool = False, return_logits: bool = False) -> StageOutput:
    """Run one op through consecutive stages in this process, handing hidden states over as tensors.

    ``x``: int64 token ids ``[n]``; ``stages[0]`` must be first and ``stages[-1]`` last. A local reference
    for what a pipeline of stage processes computes (same ops, same order, same bytes).
    """
    h = x
    for s in stages[:-1]:
        h = s.forward(h, row, start)
    return stages[-1].forward(h, row, start, all_positions=all_positions, return_logits=return_logits)


def greedy_generate(stages: Sequence[StageModel], prompt: torch.Tensor, max_new_tokens: int, row: int = 0,
                    prefill_chunk: int | None = None) -> torch.Tensor:
    """Greedy-decode ``max_new_tokens`` after ``prompt`` (int64 ``[T]``) on ``row``, starting from position 0.

    The prompt is prefilled in chunks of ``prefill_chunk`` tokens (whole when None), then one token per
    decode op. Does not stop at EOS. Returns the new token ids, int64 ``[max_new_tokens]``.

    Raises:
        KVRangeError: the prompt plus the new tokens do not fit in ``max_seq_len``.
    """
    n_prompt = prompt.shape[0]
    chunk = prefill_chunk or n_prompt
    out = None
    for start in range(0, n_prompt, chunk):
        out = run_stages(stages, prompt[start:start + chunk], row, start)
    tokens = [out.token_ids[-1]]
    for i in range(max_new_tokens - 1):
        out = run_stages(stages, tokens[-1].reshape(1), row, n_prompt + i)
        tokens.append(out.token_ids[-1])
    return torch.stack(tokens)[:max_new_tokens]
