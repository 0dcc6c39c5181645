"""A cached index of a GGUF file: its metadata and tensor table (name, type, shape, byte offset), so that a
stage process can memory-map just its own tensors without re-parsing the whole file.

``gguf.GGUFReader`` (llama.cpp's reader) parses every metadata field, including the tokenizer's 49k-entry
vocab and merges arrays, one numpy view at a time: 5 s on an idle core here, 18 s under load, in every
stage process. The first open parses with GGUFReader and saves the index as JSON under
``~/.cache/ringshm/gguf/<key>.json``; ``key`` hashes the file's name, size and modification time, so a
changed file gets a new entry. Later opens read the JSON (milliseconds) and ``np.memmap`` the tensor bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_VERSION = 1
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "ringshm"
MAX_INLINE_ARRAY = 64  # metadata arrays longer than this (vocab, merges) are indexed by length only


def file_key(path: str | Path) -> str:
    """Cache key of a file: sha256 of its name, size and mtime (ns), first 16 hex digits."""
    p = Path(path)
    st = p.stat()
    return hashlib.sha256(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: ggml type code, shape in GGUF order (innermost dim first), absolute byte
    offset of its data in the file, and its size in bytes."""

    qtype: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


class GGUFIndex:
    """Metadata and tensor table of one GGUF file. Use ``GGUFIndex.open(path)``.

    ``meta``: scalar and short-array metadata by key; ``array_lengths``: the length of every array field
    (long ones are not stored); ``tensors``: ``TensorEntry`` by tensor name.
    """

    def __init__(self, path: Path, meta: dict, array_lengths: dict[str, int], tensors: dict[str, TensorEntry]):
        self.path, self.meta, self.array_lengths, self.tensors = path, meta, array_lengths, tensors
        self._mmap: np.memmap | None = None

    @classmethod
    def open(cls, path: str | Path, cache_dir: str | Path | None = None) -> "GGUFIndex":
        """Index of ``path``: from the cache when present, else parsed (and cached when the folder is
        writable).

        Raises:
            FileNotFoundError: no such file. ValueError: gguf cannot parse it.
        """
        path = Path(path)
        cache = Path(cache_dir or DEFAULT_CACHE_DIR) / "gguf" / f"{file_key(path)}.json"
        try:
            data = json.loads(cache.read_text())
            if data.get("version") == INDEX_VERSION:
                return cls._from_json(path, data)
        except (OSError, ValueError, KeyError):
            pass
        index = cls._parse(path)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False, suffix=".tmp") as f:
                json.dump(index._to_json(), f)
            os.replace(f.name, cache)
        except OSError:
            pass  # a read-only home: work from the parsed index, uncached
        return index

    @classmethod
    def _parse(cls, path: Path) -> "GGUFIndex":
        from gguf import GGUFReader, GGUFValueType

        try:
            reader = GGUFReader(str(path))
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path} is not a readable GGUF file ({exc}); give a .gguf model or an HF "
                             f"directory with config.json") from exc
        meta, lengths = {}, {}
        for key, f in reader.fields.items():
            if f.types and f.types[0] == GGUFValueType.ARRAY:
                lengths[key] = len(f.data)
                if len(f.data) <= MAX_INLINE_ARRAY:
                    meta[key] = f.contents()
            else:
                meta[key] = f.contents()
        tensors = {t.name: TensorEntry(int(t.tensor_type), tuple(int(s) for s in t.shape), int(t.data_offset),
                                       int(t.n_bytes)) for t in reader.tensors}
        return cls(path, meta, lengths, tensors)

    def _to_json(self) -> dict:
        return {"version": INDEX_VERSION, "meta": self.meta, "array_lengths": self.array_lengths,
                "tensors": {k: [t.qtype, list(t.shape), t.offset, t.n_bytes] for k, t in self.tensors.items()}}

    @classmethod
    def _from_json(cls, path: Path, data: dict) -> "GGUFIndex":
        tensors = {k: TensorEntry(q, tuple(shape), off, n) for k, (q, shape, off, n) in data["tensors"].items()}
        return cls(path, data["meta"], data["array_lengths"], tensors)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only ``uint8`` memmap view (nothing is read until it is used).

        Raises:
            KeyError: no tensor of that name. ValueError: its bytes run past the end of the file.
        """
        t = self.tensors[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        if t.offset + t.n_bytes > self._mmap.shape[0]:
            raise ValueError(f"tensor {name!r} runs past the end of {self.path}")
        return self._mmap[t.offset : t.offset + t.n_bytes]
