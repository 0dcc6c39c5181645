"""The index of a Hugging Face checkpoint directory, read with bounds: its ``config.json`` and the tensor table of
its ``*.safetensors`` shards.

- ``config.json``: at most ``MAX_CONFIG_BYTES``, UTF-8, one JSON object with no key twice (at any depth), nested
  at most ``MAX_JSON_DEPTH`` deep. What its values must be is ``ringshm.model.checkpoint_check``'s job.
- The shards: those ``model.safetensors.index.json`` names in its ``weight_map`` (transformers' rule: other
  ``*.safetensors`` files beside them, such as Mistral's ``consolidated.safetensors``, are not the model's), or
  every ``*.safetensors`` file when there is no index. A shard's header is an 8-byte little-endian length and
  that much JSON; the length is checked against the file and ``MAX_SAFETENSORS_HEADER`` here, then the
  ``safetensors`` package parses and validates the rest (known dtypes, offsets that tile the data exactly with no
  gap or overlap, byte sizes that match the shapes). A tensor defined in two shards, or in another shard than
  the index says, is refused: which one would hold is undefined.

Everything refused here is an ``InvalidCheckpoint`` naming the file and what broke.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ringshm.errors import InvalidCheckpoint

MAX_CONFIG_BYTES = 1 << 20  # config.json (real ones: 1-20 KiB)
MAX_JSON_DEPTH = 32  # nesting of config.json / the shard index (real configs: 3)
MAX_INDEX_BYTES = 16 << 20  # model.safetensors.index.json (a 405B model's: ~100 KiB)
MAX_SAFETENSORS_HEADER = 16 << 20  # one shard's JSON header (a 70B shard: ~40 KiB; the package's own cap: 100 MB)
SHARD_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFTensor:
    """One tensor of a shard: safetensors dtype name (``"F32"``, ``"BF16"``, ...), shape (outermost first), the
    shard file."""

    dtype: str
    shape: tuple[int, ...]
    file: Path


def _no_twice(where: str):
    def hook(pairs: list[tuple[str, object]]) -> dict:
        out = {}
        for k, v in pairs:
            if k in out:
                raise InvalidCheckpoint(f"{where}: key {k!r} appears twice in one object: which one holds is "
                                        f"undefined")
            out[k] = v
        return out

    return hook


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` in JSON text, outside strings (regular expressions, no recursion)."""
    marks = [1 if c in "[{" else -1 for c in _BRACKET.findall(_JSON_STRING.sub("", text))]
    return max(itertools.accumulate(marks), default=0)


def read_json_object(path: Path, cap: int) -> dict:
    """The JSON object in ``path``, read with the caps above.

    Raises:
        InvalidCheckpoint: larger than ``cap`` bytes, not UTF-8, not JSON, nested deeper than ``MAX_JSON_DEPTH``,
            a key twice in one object, or not an object at the top (each naming the file and what was found).
    """
    size = path.stat().st_size
    if size > cap:
        raise InvalidCheckpoint(f"{path} is {size} bytes: more than the {cap} allowed")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidCheckpoint(f"{path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    deepest = _depth(text)
    if deepest > MAX_JSON_DEPTH:
        raise InvalidCheckpoint(f"{path} nests {deepest} levels deep: more than the {MAX_JSON_DEPTH} allowed")
    try:
        value = json.loads(text, object_pairs_hook=_no_twice(str(path)))
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidCheckpoint(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidCheckpoint(f"{path} holds a JSON {type(value).__name__}: expected an object of settings")
    return value


class HFIndex:
    """``config.json`` (a dict) and the tensor table (``HFTensor`` by name) of an HF directory; use
    ``HFIndex.open(path)``. ``header_bytes``: each shard's header length (8 + its JSON), which ``header_digest``
    hashes."""

    def __init__(self, path: Path, config: dict, tensors: dict[str, HFTensor], header_bytes: dict[Path, int]):
        self.path, self.config, self.tensors, self.header_bytes = path, config, tensors, header_bytes

    @classmethod
    def open(cls, path: str | Path) -> HFIndex:
        """Read ``path/config.json`` and every shard's header (see the module docstring).

        Raises:
            FileNotFoundError: no ``config.json``. MissingTensor: no shard. InvalidCheckpoint: as above.
        """
        from ringshm.errors import MissingTensor

        path = Path(path)
        config = read_json_object(path / "config.json", MAX_CONFIG_BYTES)
        index = path / SHARD_INDEX
        weight_map = None
        if index.is_file():
            weight_map = read_json_object(index, MAX_INDEX_BYTES).get("weight_map")
            if not isinstance(weight_map, dict) or not all(
                    isinstance(f, str) and f and "/" not in f and "\\" not in f and f not in (".", "..")
                    for f in weight_map.values()):
                raise InvalidCheckpoint(f"{index}: 'weight_map' must map tensor names to file names in {path}")
            files = [path / f for f in sorted(set(weight_map.values()))]
            for f in files:
                if not f.is_file():
                    raise MissingTensor(f"{index} names shard {f.name!r}, which is not in {path}")
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise MissingTensor(f"{path}: no *.safetensors files: an HF checkpoint keeps its weights in them")
        tensors: dict[str, HFTensor] = {}
        header_bytes = {}
        for f in files:
            header_bytes[f] = _shard(f, tensors)
        if weight_map is not None:
            for name, t in tensors.items():
                if weight_map.get(name) != t.file.name:
                    raise InvalidCheckpoint(f"{index}: tensor {name!r} is in shard {t.file.name!r} but the index "
                                            f"says {weight_map.get(name)!r}")
            missing = sorted(set(weight_map) - set(tensors))
            if missing:
                raise MissingTensor(f"{index} names tensor {missing[0]!r} in {weight_map[missing[0]]!r}, which does "
                                    f"not hold it")
        return cls(path, config, tensors, header_bytes)

    def header_digest(self) -> str:
        """sha256 (hex) of ``config.json`` and, per shard in name order, its size and header."""
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        for f, n in sorted(self.header_bytes.items()):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(n))
        return h.hexdigest()


def _shard(f: Path, tensors: dict[str, HFTensor]) -> int:
    """Add shard ``f``'s tensors to ``tensors``; returns its header length (8 + JSON bytes)."""
    from safetensors import SafetensorError, safe_open

    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8:
        raise InvalidCheckpoint(f"{f} is {size} bytes: too short for a safetensors header (8 bytes at least)")
    n = int.from_bytes(head, "little")
    if n > MAX_SAFETENSORS_HEADER or n > size - 8:
        raise InvalidCheckpoint(f"{f}: its header declares {n} bytes of JSON but "
                                + (f"the file has {size - 8} after the length: truncated, or a length that lies"
                                   if n > size - 8 else f"at most {MAX_SAFETENSORS_HEADER} are allowed"))
    try:
        with safe_open(str(f), framework="numpy") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                if name in tensors:
                    raise InvalidCheckpoint(f"{f}: tensor {name!r} is also in {tensors[name].file.name!r}: which one "
                                            f"holds is undefined")
                tensors[name] = HFTensor(sl.get_dtype(), tuple(int(d) for d in sl.get_shape()), f)
    except (SafetensorError, OSError) as exc:
        raise InvalidCheckpoint(f"{f} is not a valid safetensors file: {exc}") from None
    return 8 + n
