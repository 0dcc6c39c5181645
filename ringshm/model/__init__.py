"""A layer range and its math: checkpoints (GGUF index, loader, dequantization), tokenizer, weights in their
encoding and the kernels over them, ``StageModel`` (a layer range with its KV cache; it knows no processes).
May import: the base modules, ``ringshm.transport`` (the op table a stage model answers) and this folder."""
