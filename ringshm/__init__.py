"""ringshm: pipeline-parallel LLM inference on one host over lock-free shared-memory rings."""
