"""Tokenizer and chat template of a checkpoint, through transformers (GGUF metadata or an HF directory).

Building a tokenizer from GGUF metadata (vocab, merges, chat template) takes seconds, so the converted
tokenizer is saved once under ``~/.cache/ringshm/tokenizers/<key>/`` and loaded from there afterwards. The
key hashes the GGUF file's name, size and modification time: a changed file gets a new entry.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ringshm"


def tokenizer_cache_key(gguf_path: str | Path) -> str:
    """Return the cache key of a GGUF file's tokenizer: sha256 of its name, size and mtime (ns), 16 hex."""
    path = Path(gguf_path)
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def load_tokenizer(model_path: str | Path, cache_dir: str | Path | None = None):
    """Return a transformers tokenizer (with its chat template) for a ``.gguf`` file or an HF directory.

    For GGUF, the first call converts the metadata with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
    and saves the result under ``cache_dir`` (default ``~/.cache/ringshm``)/tokenizers/<key>; later calls
    load the saved copy. An HF directory is loaded as is.

    Raises:
        FileNotFoundError: ``model_path`` is neither a ``.gguf`` file nor a directory.
    """
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is wanted

    path = Path(model_path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if not (path.is_file() and path.suffix == ".gguf"):
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a model directory")
    root = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    entry = root / "tokenizers" / tokenizer_cache_key(path)
    if (entry / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(entry))
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
    try:
        tok.save_pretrained(str(tmp))
        os.replace(tmp, entry)  # atomic publish; a concurrent writer's identical entry may win
    except OSError:
        if not (entry / "tokenizer_config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok
