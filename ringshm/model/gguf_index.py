"""The index of a GGUF file: its metadata and tensor table, read from the header with every count and length
checked against the bytes that are there and against caps, so that a hostile header costs a bounded time and
memory (measured: README, "What a checkpoint must satisfy").

Layout (ggml's docs/gguf.md, versions 2 and 3, little-endian; numbers are little-endian, a string is a u64 byte
count and that many UTF-8 bytes)::

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv      x  key string | value type u32 | value       value: a scalar, a string, or
                                                          array = element type u32 | count u64 | elements
    n_tensors x  name string | n_dims u32 | dims u64 [n_dims] (innermost first) | ggml type u32 | offset u64
    padding up to general.alignment (u32, a power of two; default 32)        <- data_start
    tensor data: tensor t at data_start + t.offset (a multiple of the alignment), its bytes
                 dims[0] / block_size x type_size x the other dims (gguf.GGML_QUANT_SIZES)

The walk is ringshm's own: ``gguf.GGUFReader`` builds a numpy view per array element, which took 150 s and
7.3 GB on a 24 MB file with a 10^7-element array. Here an array of numbers is skipped by its size, and an
array of strings costs one length check (and a UTF-8 check) per element; arrays of up to
``MAX_INLINE_ARRAY`` strings or ``MAX_INLINE_NUMBERS`` numbers are kept, longer ones (vocab, merges) only by
element type and length. The
``gguf`` package still gives the value and tensor types and the block sizes, and ``transformers`` (through
``gguf.GGUFReader``) still parses the tokenizer, once this index has checked the header's bounds. The walk
is fast enough to run at every open (SmolLM2's 49k tokens and 49k merges: ~40 ms; the README's "What a checkpoint
must satisfy" times whole headers), so there is no index cache to go stale.

Everything this module refuses is an ``InvalidCheckpoint`` naming the file and what broke; what the values
mean (ranges, shapes against the model's description) is ``ringshm.model.checkpoint_check``'s job.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ringshm.errors import InvalidCheckpoint

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_INLINE_ARRAY = 64  # string arrays longer than this (vocab, merges) are indexed by type and length only
MAX_INLINE_NUMBERS = 1024  # and arrays of numbers or bools (per-layer values) longer than this

# Caps on what a header may declare (each well above what real files hold; the README lists them).
MAX_HEADER_BYTES = 64 << 20  # metadata + tensor table (Gemma 3's 262k-token vocabulary: ~6 MiB)
MAX_KV = 1 << 12  # metadata keys (real files: 20-60)
MAX_TENSORS = 1 << 16  # tensor infos (a 405B Llama: 1,138)
MAX_KEY_BYTES = 1 << 10  # a metadata key
MAX_NAME_BYTES = 1 << 8  # a tensor name (llama.cpp allows 63)
MAX_STRING_BYTES = 1 << 20  # one string value or array element (chat templates: ~10 KiB)
MAX_ARRAY_LEN = 1 << 19  # elements of one array (Gemma 3's vocabulary: 262,144)
MAX_STRINGS = 1 << 20  # string elements over all arrays (Llama 3: 128k tokens + 280k merges)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16

_SCALAR = {  # value type -> struct format
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<B", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the file: ggml type code, shape in GGUF order (innermost dim first), absolute byte
    offset of its data in the file, and its size in bytes."""

    qtype: int
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


class GGUFIndex:
    """Metadata and tensor table of one GGUF file, read with bounds (``GGUFIndex.open(path)``).

    ``meta``: scalars (int, float, bool, str) and the arrays short enough to keep (lists) by key;
    ``array_lengths`` / ``array_types``: every array's length and element type name (``"STRING"``,
    ``"FLOAT32"``, ...); ``tensors``: ``TensorEntry`` by name; ``data_start``: where tensor data begins (the
    header is the bytes before it); ``file_bytes``: the file's size when it was read.
    """

    def __init__(self, path: Path, meta: dict, array_lengths: dict[str, int], array_types: dict[str, str],
                 tensors: dict[str, TensorEntry], data_start: int, file_bytes: int):
        self.path, self.meta, self.array_lengths, self.array_types = path, meta, array_lengths, array_types
        self.tensors, self.data_start, self.file_bytes = tensors, data_start, file_bytes
        self._mmap: np.memmap | None = None

    @classmethod
    def open(cls, path: str | Path) -> GGUFIndex:
        """Read and check ``path``'s header (see the module docstring for what is checked).

        Raises:
            FileNotFoundError: no such file. InvalidCheckpoint: the header breaks the format or a cap (the
            message names the key, tensor or count, what it held and what was expected).
        """
        path = Path(path)
        size = path.stat().st_size
        if size < 24:
            raise InvalidCheckpoint(f"{path}: {size} bytes is too short for a GGUF header (24 bytes at least)")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Walk(path, buf, size).index()

    def header_digest(self) -> str:
        """sha256 (hex) of the file's size and its whole header (metadata and tensor table, ``[0, data_start)``):
        two files with the same header describe the same model and tokenizer, whatever their names and times."""
        h = hashlib.sha256(str(self.file_bytes).encode())
        with open(self.path, "rb") as f:
            h.update(f.read(self.data_start))
        return h.hexdigest()

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only ``uint8`` memmap view (nothing is read until it is used).

        Raises:
            KeyError: no tensor of that name. InvalidCheckpoint: its bytes run past the end of the file (it
            shrank since it was indexed).
        """
        t = self.tensors[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        if t.offset + t.n_bytes > self._mmap.shape[0]:
            raise InvalidCheckpoint(f"{self.path}: tensor {name!r} runs past the end of the file "
                                    f"({t.offset + t.n_bytes} > {self._mmap.shape[0]} bytes)")
        return self._mmap[t.offset : t.offset + t.n_bytes]

    def drop_pages(self) -> None:
        """Unmap this process's view of the file's pages (``madvise(MADV_DONTNEED)`` over the whole map): its RSS
        and PSS stop counting them, the page cache keeps them (shared, reclaimable), and a later read of a view
        faults them back in. For a stage that has packed its weights and reads the file only for embedding rows."""
        if self._mmap is not None and hasattr(self._mmap, "_mmap") and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap._mmap.madvise(mmap.MADV_DONTNEED)


class _Walk:
    """One pass over a mapped header; every read is checked against the file's end and the header cap."""

    def __init__(self, path: Path, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.off = path, buf, size, 0
        self.end = min(size, MAX_HEADER_BYTES)  # no header byte is read past this
        self.n_strings = 0

    def bad(self, what: str) -> InvalidCheckpoint:
        return InvalidCheckpoint(f"{self.path}: {what}")

    def room(self, n: int, what: str, at: int | None = None) -> None:
        """Raise unless the ``n`` header bytes from ``at`` (default: here) are in the file and under the cap."""
        at = self.off if at is None else at
        if n > self.end - at:
            if at + n <= self.size:
                raise self.bad(f"{what}: the header runs past {MAX_HEADER_BYTES >> 20} MiB (the cap on metadata "
                               f"and tensor table together)")
            raise self.bad(f"{what} needs {n} bytes at offset {at} but the file ends at {self.size}: "
                           f"truncated, or a length that lies")

    def take(self, n: int, what: str) -> int:
        """Claim the next ``n`` header bytes; returns where they start."""
        self.room(n, what)
        at = self.off
        self.off += n
        return at

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str, cap: int, keep: bool = True) -> str | None:
        n = self.u64(f"{what}'s length")
        if n > cap:
            raise self.bad(f"{what} is {n} bytes long: more than the {cap} allowed")
        at = self.take(n, what)
        try:
            text = self.buf[at : at + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.bad(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        return text if keep else None

    def strings(self, n: int, what: str, keep: bool) -> list[str] | None:
        """The ``n`` strings of an array (the inner loop of a 262k-token vocabulary: kept flat)."""
        buf, off, end, unpack, out = self.buf, self.off, self.end, _U64.unpack_from, []
        for i in range(n):
            self.off = off
            if end - off < 8:
                self.room(8, f"{what}[{i}]'s length")
            length = unpack(buf, off)[0]
            off += 8
            if length > MAX_STRING_BYTES:
                raise self.bad(f"{what}[{i}] is {length} bytes long: more than the {MAX_STRING_BYTES} allowed")
            if length > end - off:
                self.room(length, f"{what}[{i}]", off)
            try:
                text = buf[off : off + length].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.bad(f"{what}[{i}] is not UTF-8 ({exc.reason} at byte {exc.start})") from None
            if keep:
                out.append(text)
            off += length
        self.off = off
        return out if keep else None

    def value(self, vtype: int, what: str, keep: bool = True):
        """One scalar or string of type ``vtype``."""
        if vtype == GGUFValueType.STRING:
            return self.string(what, MAX_STRING_BYTES, keep)
        fmt = _SCALAR[GGUFValueType(vtype)]
        v = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]
        if vtype == GGUFValueType.BOOL:
            if v > 1:
                raise self.bad(f"{what} is a bool stored as {v}: expected 0 or 1")
            v = bool(v)
        return v

    def value_type(self, what: str, in_array: bool = False) -> GGUFValueType:
        t = self.u32(f"{what}'s type")
        try:
            vt = GGUFValueType(t)
        except ValueError:
            raise self.bad(f"{what} has value type {t}: not a GGUF type (0-12)") from None
        if in_array and vt == GGUFValueType.ARRAY:
            raise self.bad(f"{what} is an array of arrays: no key ringshm reads holds one")
        return vt

    def array(self, what: str) -> tuple[GGUFValueType, int, list | None]:
        """(element type, length, the elements when at most MAX_INLINE_ARRAY) of an array value."""
        etype = self.value_type(f"{what}'s elements", in_array=True)
        n = self.u64(f"{what}'s length")
        if n > MAX_ARRAY_LEN:
            raise self.bad(f"{what} declares {n} elements: more than the {MAX_ARRAY_LEN} allowed")
        keep = n <= (MAX_INLINE_ARRAY if etype == GGUFValueType.STRING else MAX_INLINE_NUMBERS)
        if etype == GGUFValueType.STRING:
            self.n_strings += n
            if self.n_strings > MAX_STRINGS:
                raise self.bad(f"{what} brings the strings in metadata arrays to {self.n_strings}: more than the "
                               f"{MAX_STRINGS} allowed")
            self.room(n * 8, f"{what}'s {n} strings")  # each holds at least its 8-byte length
            return etype, n, self.strings(n, what, keep)
        width = struct.calcsize(_SCALAR[etype])
        at = self.take(n * width, f"{what}'s {n} elements")
        if not keep:
            return etype, n, None
        items = list(struct.unpack_from(f"<{n}{_SCALAR[etype][1]}", self.buf, at))
        if etype == GGUFValueType.BOOL:
            if any(v > 1 for v in items):
                raise self.bad(f"{what} holds a bool stored as neither 0 nor 1")
            items = [bool(v) for v in items]
        return etype, n, items

    def index(self) -> GGUFIndex:
        if bytes(self.buf[:4]) != MAGIC:
            raise self.bad(f"starts with {bytes(self.buf[:4])!r}, not the GGUF magic {MAGIC!r}: not a GGUF file")
        self.off = 4
        version = self.u32("the version")
        if version not in VERSIONS:
            swapped = struct.unpack("<I", struct.pack(">I", version))[0]
            why = " (a big-endian file: ringshm reads little-endian ones)" if swapped in VERSIONS else ""
            raise self.bad(f"GGUF version {version}{why}: expected 2 or 3")
        n_tensors, n_kv = self.u64("the tensor count"), self.u64("the metadata key count")
        # the smallest metadata entry is 13 bytes (key length, one-byte key, type, u8), a tensor info 33
        for what, n, cap, least in (("metadata keys", n_kv, MAX_KV, 13), ("tensors", n_tensors, MAX_TENSORS, 33)):
            if n > cap:
                raise self.bad(f"the header declares {n} {what}: more than the {cap} allowed")
        if n_kv * 13 + n_tensors * 33 > self.size - self.off:
            raise self.bad(f"the header declares {n_kv} metadata keys and {n_tensors} tensors, more than the file's "
                           f"{self.size} bytes can hold: truncated, or counts that lie")
        meta, lengths, types = {}, {}, {}
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}'s name", MAX_KEY_BYTES)
            if key in meta or key in lengths:
                raise self.bad(f"metadata key {key!r} appears twice (#{i}): which one holds is undefined")
            what = f"metadata {key!r}"
            vtype = self.value_type(what)
            if vtype == GGUFValueType.ARRAY:
                etype, n, items = self.array(what)
                lengths[key], types[key] = n, etype.name
                if items is not None:
                    meta[key] = items
            else:
                meta[key] = self.value(vtype, what)
        infos = []
        for i in range(n_tensors):
            name = self.string(f"tensor #{i}'s name", MAX_NAME_BYTES)
            n_dims = self.u32(f"tensor {name!r}'s rank")
            if not 1 <= n_dims <= MAX_DIMS:
                raise self.bad(f"tensor {name!r} has {n_dims} dimensions: expected 1 to {MAX_DIMS}")
            dims = tuple(self.u64(f"tensor {name!r}'s dims") for _ in range(n_dims))
            qtype = self.u32(f"tensor {name!r}'s type")
            offset = self.u64(f"tensor {name!r}'s offset")
            infos.append((name, dims, qtype, offset))
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in lengths or isinstance(alignment, (bool, float, str)) or not (
                1 <= alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
            raise self.bad(f"metadata 'general.alignment' = {alignment!r}: expected a power of two in 1 .. "
                           f"{MAX_ALIGNMENT}")
        data_start = -(-self.off // alignment) * alignment
        tensors = {}
        for name, dims, qtype, offset in infos:
            if name in tensors:
                raise self.bad(f"tensor {name!r} is defined twice: which one holds is undefined")
            tensors[name] = self.tensor(name, dims, qtype, offset, data_start, alignment)
        spans = sorted((t.offset, t.offset + t.n_bytes, name) for name, t in tensors.items())
        for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:]):
            if start_b < end_a:
                raise self.bad(f"tensors {a!r} and {b!r} overlap: {a!r}'s bytes end at {end_a}, {b!r}'s start at "
                               f"{start_b}")
        return GGUFIndex(self.path, meta, lengths, types, tensors, data_start, self.size)

    def tensor(self, name: str, dims: tuple[int, ...], qtype: int, offset: int, data_start: int,
               alignment: int) -> TensorEntry:
        try:
            qt = GGMLQuantizationType(qtype)
            block, type_bytes = GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise self.bad(f"tensor {name!r} has ggml type {qtype}: not one the gguf package knows") from None
        if min(dims) < 1:
            raise self.bad(f"tensor {name!r} has shape {list(dims)}: every dimension must be at least 1")
        if dims[0] % block:
            raise self.bad(f"tensor {name!r} of type {qt.name} has a row of {dims[0]} weights: not whole blocks of "
                           f"{block}")
        n_el = 1
        for d in dims:
            n_el *= d
        n_bytes = n_el // block * type_bytes
        start = data_start + offset
        if offset % alignment:
            raise self.bad(f"tensor {name!r} starts at data offset {offset}: not a multiple of the alignment "
                           f"{alignment}")
        if n_bytes > self.size - min(start, self.size):
            raise self.bad(f"tensor {name!r} ({qt.name} {list(dims)}, {n_bytes} bytes at file offset {start}) runs "
                           f"past the end of the file at {self.size}")
        return TensorEntry(int(qt), dims, start, n_bytes)
