"""What names a checkpoint's content, for the caches keyed by it and for the nodes of a multi-host engine that must
hold the same model: one digest (``checkpoint_digest``), used by both.

- The tokenizer cache (``ringshm.model.tokenizer``) keys an entry on the file's resolved path and its
  ``checkpoint_digest``: the whole GGUF header (metadata, tokenizer, tensor table) and the file's size. Two files
  of one shape with equal size and times (``cp -p``, ``rsync -a``) but another tokenizer or ``rms_eps`` no longer
  share an entry, as they did when the key was the name, size and mtime.
- ``fingerprint`` adds the model config, the layer split and 64 blocks of 4 KiB spread over each file (a
  different fine-tune of one shape has the same header), so a worker whose copy differs is refused
  (``ringshm.transport.cluster``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from ringshm.model_config import ModelConfig

SAMPLE_BYTES = 4096


def checkpoint_digest(model_path: str | Path, samples: int = 0) -> str:
    """sha256 (hex) of a ``.gguf`` file's or HF directory's headers (``GGUFIndex.header_digest``,
    ``HFIndex.header_digest``: sizes, metadata, tensor tables; ``config.json``) and ``samples`` blocks of
    ``SAMPLE_BYTES`` at even steps through each tensor file. Reads the headers with bounds (the indexes).

    Raises:
        FileNotFoundError, InvalidCheckpoint: as ``GGUFIndex.open`` / ``HFIndex.open``.
    """
    from ringshm.model.gguf_index import GGUFIndex
    from ringshm.model.hf_index import HFIndex

    p = Path(model_path)
    if p.is_dir():
        index = HFIndex.open(p)
        files = sorted(index.header_bytes)
    else:
        index = GGUFIndex.open(p)
        files = [p]
    h = hashlib.sha256(index.header_digest().encode())
    for f in files if samples else ():
        size = f.stat().st_size
        with open(f, "rb") as fh:
            for i in range(samples):
                fh.seek(i * size // samples)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()


def fingerprint(model_path: str | Path, mc: ModelConfig, layer_ranges: list[range], samples: int = 64) -> str:
    """sha256 (hex) over the model config, the layer split and ``checkpoint_digest(model_path, samples)``: equal on
    two hosts when they run the same checkpoint the same way. Cheap for any size (the headers and 64 x 4 KiB per
    file; a full hash of a 70 GB file takes minutes), and a different quantization, fine-tune or split changes it."""
    h = hashlib.sha256()
    h.update(json.dumps(asdict(mc), sort_keys=True).encode())
    h.update(json.dumps([[r.start, r.stop] for r in layer_ranges]).encode())
    h.update(checkpoint_digest(model_path, samples).encode())
    return h.hexdigest()
