"""The coordinator side: the link to the first and last stage, the scheduler, speculative decoding, sampling,
logprobs, results, ``Engine`` (blocking) and ``AsyncEngine`` (asyncio, a dispatcher thread).
May import: the base modules, ``ringshm.transport``, ``ringshm.model``, ``ringshm.runtime`` and this folder."""
