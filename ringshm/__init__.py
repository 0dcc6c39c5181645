"""ringshm: pipeline-parallel LLM inference on one host over lock-free shared-memory rings."""

from ringshm.ring import Ring

__all__ = ["Ring"]
__version__ = "0.1.0"
