"""A corpus of malformed checkpoints (issue 27): a tiny valid Llama as a GGUF file and as an HF directory, and
named mutations of each, one per class of lie a model file can tell.

The GGUF side is written by hand (``gguf_bytes``: the layout in ``ringshm.model.gguf_index``'s docstring), from
a structure that a mutation edits before it is serialised: ``gguf.GGUFWriter`` only writes well-formed files,
and most of these are not. Each case is ``(build, error type, words the one-line message must hold)``; a case's
``build(path)`` writes the file (or directory) and returns the path to open. Big cases (a 10^7-element array, a
100 MB string) write sparse or cheap files.

The model: Llama, 2 layers, hidden 64, 4 query heads and 2 KV heads of 16, intermediate 128, vocabulary 128,
tied embeddings, fp32 weights (norms near 1), a GGUF tokenizer section (128 tokens, their types, BOS 1, EOS 2)
and a chat template.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from ringshm.errors import InvalidCheckpoint, MissingTensor, UnsupportedArchitecture

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 64, 4, 2, 16, 128, 2, 128
_FMT = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
        VT.FLOAT32: "<f", VT.BOOL: "<B", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: VT, value, etype: VT | None = None) -> bytes:
    if vtype == VT.STRING:
        return _str(value)
    if vtype == VT.ARRAY:
        return struct.pack("<IQ", etype, len(value)) + b"".join(_value(etype, v) for v in value)
    return struct.pack(_FMT[vtype], value)


@dataclass
class KV:
    """A metadata entry; ``raw`` replaces the serialised value (type included) with bytes of the case's choosing."""

    key: str
    vtype: VT
    value: object = None
    etype: VT | None = None
    raw: bytes | None = None

    def encode(self) -> bytes:
        if self.raw is not None:
            return _str(self.key) + self.raw
        return _str(self.key) + struct.pack("<I", self.vtype) + _value(self.vtype, self.value, self.etype)


@dataclass
class Tensor:
    """A tensor info and its bytes; ``offset`` None: placed after the previous one, aligned."""

    name: str
    dims: tuple[int, ...]  # GGUF order, innermost first
    qtype: int
    data: bytes
    offset: int | None = None
    shift: int = 0  # added to the offset it would get (a misaligned tensor)


@dataclass
class GGUFFile:
    kvs: list[KV]
    tensors: list[Tensor]
    magic: bytes = b"GGUF"
    version: int = 3
    n_kv: int | None = None  # the declared counts (None: the true ones)
    n_tensors: int | None = None
    alignment: int = 32
    truncate_at: int | None = None
    extra: dict = field(default_factory=dict)

    def kv(self, key: str) -> KV:
        return next(k for k in self.kvs if k.key == key)

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def encode(self) -> bytes:
        head = self.magic + struct.pack("<IQQ", self.version, len(self.tensors) if self.n_tensors is None
                                        else self.n_tensors, len(self.kvs) if self.n_kv is None else self.n_kv)
        head += b"".join(k.encode() for k in self.kvs)
        offsets, at = [], 0
        for t in self.tensors:  # each after the previous one, aligned, unless the case placed it
            at = -(-at // self.alignment) * self.alignment
            offsets.append((at if t.offset is None else t.offset) + t.shift)
            at += len(t.data)
        for t, off in zip(self.tensors, offsets):
            head += _str(t.name) + struct.pack("<I", len(t.dims)) + b"".join(struct.pack("<Q", d) for d in t.dims)
            head += struct.pack("<IQ", t.qtype, off)
        data_start = -(-len(head) // self.alignment) * self.alignment
        placed = [(off, t.data) for t, off in zip(self.tensors, offsets) if off < 2**40]
        out = bytearray(head) + bytes(data_start - len(head) + max((o + len(d) for o, d in placed), default=0))
        for off, data in placed:
            out[data_start + off:data_start + off + len(data)] = data
        return bytes(out if self.truncate_at is None else out[: self.truncate_at])

    def write(self, path: Path) -> Path:
        path.write_bytes(self.encode())
        return path


def _f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The tiny Llama's tensors by HF name, fp32, torch order ([out, in])."""
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)) * 0.5,
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN)}
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name, shape in (("input_layernorm", (HIDDEN,)), ("post_attention_layernorm", (HIDDEN,)),
                            ("self_attn.q_proj", (q, HIDDEN)), ("self_attn.k_proj", (kv, HIDDEN)),
                            ("self_attn.v_proj", (kv, HIDDEN)), ("self_attn.o_proj", (HIDDEN, q)),
                            ("mlp.gate_proj", (INTER, HIDDEN)), ("mlp.up_proj", (INTER, HIDDEN)),
                            ("mlp.down_proj", (HIDDEN, INTER))):
            norm = len(shape) == 1
            w[p + name + ".weight"] = (1 + 0.1 * rng.standard_normal(shape)) if norm else \
                rng.standard_normal(shape) / np.sqrt(shape[1])
    return {k: v.astype(np.float32) for k, v in w.items()}


_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_GGUF_LAYER[rest.rsplit('.', 1)[0]]}.weight"


def tiny_gguf(seed: int = 0) -> GGUFFile:
    """The valid tiny Llama as a ``GGUFFile`` (weights from ``tiny_weights``; q/k rows as stored, no reorder: the
    corpus checks the container and the description, not the numbers)."""
    kvs = [KV("general.architecture", VT.STRING, "llama"), KV("general.name", VT.STRING, "corpus tiny"),
           KV("llama.block_count", VT.UINT32, LAYERS), KV("llama.context_length", VT.UINT32, 256),
           KV("llama.embedding_length", VT.UINT32, HIDDEN), KV("llama.feed_forward_length", VT.UINT32, INTER),
           KV("llama.attention.head_count", VT.UINT32, HEADS), KV("llama.attention.head_count_kv", VT.UINT32, KV_HEADS),
           KV("llama.rope.freq_base", VT.FLOAT32, 10000.0),
           KV("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-5),
           KV("llama.vocab_size", VT.UINT32, VOCAB), KV("llama.rope.dimension_count", VT.UINT32, HEAD_DIM),
           KV("tokenizer.ggml.model", VT.STRING, "gpt2"),
           KV("tokenizer.ggml.tokens", VT.ARRAY, [f"t{i}" for i in range(VOCAB)], VT.STRING),
           KV("tokenizer.ggml.token_type", VT.ARRAY, [1] * VOCAB, VT.INT32),
           KV("tokenizer.ggml.bos_token_id", VT.UINT32, 1), KV("tokenizer.ggml.eos_token_id", VT.UINT32, 2),
           KV("tokenizer.chat_template", VT.STRING, "{% for m in messages %}{{ m.content }}{% endfor %}")]
    tensors = [Tensor(gguf_name(n), tuple(reversed(a.shape)), QT.F32, _f32(a)) for n, a in tiny_weights(seed).items()]
    return GGUFFile(kvs, tensors)


def tiny_hf_config() -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu"}


def safetensors_bytes(tensors: dict[str, np.ndarray], header_edit: Callable[[dict], None] | None = None) -> bytes:
    """A safetensors file of ``tensors`` (name order, contiguous), its JSON header edited by ``header_edit``."""
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": {np.float32: "F32", np.float16: "F16", np.int32: "I32"}[a.dtype.type],
                        "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    if header_edit:
        header_edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def write_hf(path: Path, config: dict | str | bytes | None = None, shards: dict[str, bytes] | None = None,
             extra: dict[str, bytes] | None = None) -> Path:
    """An HF directory: ``config.json`` (a dict as JSON, or the text / bytes as given) and its shards."""
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config() if config is None else config
    text = json.dumps(config) if isinstance(config, dict) else config
    (path / "config.json").write_bytes(text.encode() if isinstance(text, str) else text)
    for name, data in (shards if shards is not None else {"model.safetensors": safetensors_bytes(tiny_weights())}
                       ).items():
        (path / name).write_bytes(data)
    for name, data in (extra or {}).items():
        (path / name).write_bytes(data)
    return path


@dataclass(frozen=True)
class Case:
    """One malformed checkpoint: ``build(dir) -> path`` writes it under ``dir``; opening it must raise ``error``
    with every one of ``words`` in its one-line message."""

    build: Callable[[Path], Path]
    error: type
    words: tuple[str, ...]


def _g(edit: Callable[[GGUFFile], None]) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        f = tiny_gguf()
        edit(f)
        return f.write(d / "model.gguf")
    return build


def _set(key: str, vtype: VT, value, etype: VT | None = None) -> Callable[[GGUFFile], None]:
    def edit(f: GGUFFile) -> None:
        kv = next((k for k in f.kvs if k.key == key), None)
        if kv is None:
            f.kvs.append(KV(key, vtype, value, etype))
        else:
            kv.vtype, kv.value, kv.etype = vtype, value, etype
    return edit


def _yarn(*extra: tuple[str, float]) -> Callable[[GGUFFile], None]:
    """YaRN scaling (factor 4 over 32 original positions) plus ``extra`` float keys."""
    def edit(f: GGUFFile) -> None:
        for key, vtype, value in (("llama.rope.scaling.type", VT.STRING, "yarn"),
                                  ("llama.rope.scaling.factor", VT.FLOAT32, 4.0),
                                  ("llama.rope.scaling.original_context_length", VT.UINT32, 32),
                                  *((k, VT.FLOAT32, v) for k, v in extra)):
            _set(key, vtype, value)(f)
    return edit


def _drop_key(key: str) -> Callable[[GGUFFile], None]:
    return lambda f: f.kvs.remove(f.kv(key))


def _tensor(name: str, **changes) -> Callable[[GGUFFile], None]:
    def edit(f: GGUFFile) -> None:
        i = next(i for i, t in enumerate(f.tensors) if t.name == name)
        f.tensors[i] = replace(f.tensors[i], **changes)
    return edit


def _sparse_string(d: Path) -> Path:
    """A GGUF whose chat template is a real 100 MB string (a sparse file: zeros cost no disk)."""
    f = tiny_gguf()
    n = 100_000_000
    f.kvs.append(KV("general.description", VT.STRING, raw=struct.pack("<IQ", VT.STRING, n)))
    head = f.encode()  # the string's bytes would follow its length; the file holds them (zeros), then the rest
    path = d / "model.gguf"
    with open(path, "wb") as fh:
        fh.write(head)
        fh.truncate(len(head) + n)
    return path


def _big_array(d: Path) -> Path:
    """A 10 MB GGUF whose metadata holds a real 10^7-element int8 array."""
    f = tiny_gguf()
    f.kvs.append(KV("general.junk", VT.ARRAY, raw=struct.pack("<IIQ", VT.ARRAY, VT.INT8, 10**7) + bytes(10**7)))
    return f.write(d / "model.gguf")


def _big_vocab(d: Path) -> Path:
    """A GGUF with a real 10^6-token vocabulary (and a 10^6-row embedding declared)."""
    f = tiny_gguf()
    tokens = b"".join(_str(f"t{i}") for i in range(10**6))
    f.kv("tokenizer.ggml.tokens").raw = struct.pack("<IIQ", VT.ARRAY, VT.STRING, 10**6) + tokens
    return f.write(d / "model.gguf")


def _claim_experts(f: GGUFFile) -> None:
    """Metadata of 1024 layers of 1024 experts, a tensor per expert; tensors for layer 1023 and expert 0 only."""
    for key, value in (("llama.block_count", 1024), ("llama.expert_count", 1024), ("llama.expert_used_count", 2)):
        _set(key, VT.UINT32, value)(f)
    f.tensors.append(replace(f.tensor("blk.0.attn_norm.weight"), name="blk.1023.attn_norm.weight"))
    f.tensors.append(replace(f.tensor("blk.0.ffn_gate.weight"), name="blk.0.ffn_gate.0.weight"))


def _overlap(f: GGUFFile) -> None:
    a, b = f.tensor("blk.0.attn_q.weight"), f.tensor("blk.0.attn_k.weight")
    a.offset, b.offset = 0, 0
    for t in f.tensors:  # the others after them, in order
        if t.offset is None:
            t.offset = -(-sum(len(x.data) for x in f.tensors[: f.tensors.index(t)]) // 32) * 32 + 4096 * 64


GGUF_CASES: dict[str, Case] = {
    "empty": Case(lambda d: (d / "model.gguf").write_bytes(b"") or d / "model.gguf", InvalidCheckpoint, ("too short",)),
    "not_gguf": Case(_g(lambda f: setattr(f, "magic", b"GGML")), InvalidCheckpoint, ("not a GGUF file",)),
    "version_1": Case(_g(lambda f: setattr(f, "version", 1)), InvalidCheckpoint, ("version 1",)),
    "big_endian": Case(_g(lambda f: setattr(f, "version", 3 << 24)), InvalidCheckpoint, ("big-endian",)),
    "truncated_1000": Case(_g(lambda f: setattr(f, "truncate_at", 1000)), InvalidCheckpoint, ("truncated",)),
    "truncated_in_data": Case(_g(lambda f: setattr(f, "truncate_at", len(f.encode()) - 100)), InvalidCheckpoint,
                              ("runs past the end of the file",)),
    "kv_count_huge": Case(_g(lambda f: setattr(f, "n_kv", 2**40)), InvalidCheckpoint, ("metadata keys", "allowed")),
    "kv_count_past_file": Case(_g(lambda f: (setattr(f, "n_kv", 4000), setattr(f, "truncate_at", 20000))),
                               InvalidCheckpoint, ("4000 metadata keys", "more than the file")),
    "tensor_count_past_file": Case(_g(lambda f: setattr(f, "n_tensors", 60000)), InvalidCheckpoint,
                                   ("more than the file",)),
    "kv_count_one_more": Case(_g(lambda f: setattr(f, "n_kv", len(f.kvs) + 1)), InvalidCheckpoint, ()),
    "key_length_lies": Case(_g(lambda f: setattr(f.kvs[3], "key", b"x")), InvalidCheckpoint, ()),
    "string_length_lies": Case(_g(lambda f: setattr(f.kv("general.name"), "raw",
                                                    struct.pack("<IQ", VT.STRING, 2**62) + b"corpus")),
                               InvalidCheckpoint, ("general.name", "bytes long")),
    "string_past_file": Case(_g(lambda f: setattr(f.kv("tokenizer.chat_template"), "raw",
                                                  struct.pack("<IQ", VT.STRING, 900_000) + b"{{")),
                             InvalidCheckpoint, ("tokenizer.chat_template", "truncated")),
    "string_100mb": Case(_sparse_string, InvalidCheckpoint, ("general.description", "100000000 bytes")),
    "array_length_lies": Case(_g(lambda f: setattr(f.kv("tokenizer.ggml.token_type"), "raw",
                                                   struct.pack("<IIQ", VT.ARRAY, VT.INT32, 10**7))),
                              InvalidCheckpoint, ("tokenizer.ggml.token_type", "10000000 elements")),
    "array_1e7_real": Case(_big_array, InvalidCheckpoint, ("general.junk", "10000000 elements")),
    "vocab_1e6_real": Case(_big_vocab, InvalidCheckpoint, ("tokenizer.ggml.tokens", "1000000 elements")),
    "array_of_arrays": Case(_g(lambda f: f.kvs.append(KV("general.tags", VT.ARRAY, raw=struct.pack(
        "<IIQIQB", VT.ARRAY, VT.ARRAY, 1, VT.UINT8, 1, 1)))), InvalidCheckpoint, ("general.tags", "array of arrays")),
    "value_type_unknown": Case(_g(lambda f: setattr(f.kv("general.name"), "raw", struct.pack("<I", 13))),
                               InvalidCheckpoint, ("general.name", "value type 13")),
    "bool_not_0_1": Case(_g(lambda f: f.kvs.append(KV("tokenizer.ggml.add_bos_token", VT.BOOL,
                                                      raw=struct.pack("<IB", VT.BOOL, 7)))),
                         InvalidCheckpoint, ("add_bos_token", "0 or 1")),
    "key_not_utf8": Case(_g(lambda f: setattr(f.kvs[1], "key", b"general.\xff\xfename")), InvalidCheckpoint,
                         ("not UTF-8",)),
    "duplicate_key": Case(_g(lambda f: f.kvs.append(KV("llama.block_count", VT.UINT32, 1))), InvalidCheckpoint,
                          ("llama.block_count", "twice")),
    "duplicate_tensor": Case(_g(lambda f: f.tensors.append(replace(f.tensors[1]))), InvalidCheckpoint,
                             ("output_norm.weight", "twice")),
    "alignment_zero": Case(_g(_set("general.alignment", VT.UINT32, 0)), InvalidCheckpoint, ("general.alignment",)),
    "alignment_not_pow2": Case(_g(_set("general.alignment", VT.UINT32, 48)), InvalidCheckpoint,
                               ("general.alignment", "power of two")),
    "architecture_missing": Case(_g(_drop_key("general.architecture")), InvalidCheckpoint, ("general.architecture",)),
    "architecture_int": Case(_g(_set("general.architecture", VT.UINT32, 7)), InvalidCheckpoint,
                             ("general.architecture",)),
    "architecture_unknown": Case(_g(_set("general.architecture", VT.STRING, "gpt2")), UnsupportedArchitecture,
                                 ("gpt2",)),
    "context_length_missing": Case(_g(_drop_key("llama.context_length")), InvalidCheckpoint,
                                   ("llama.context_length", "missing")),
    "block_count_1e9": Case(_g(_set("llama.block_count", VT.UINT32, 10**9)), InvalidCheckpoint,
                            ("llama.block_count", "1000000000")),
    "block_count_past_tensors": Case(_g(_set("llama.block_count", VT.UINT32, 5)), InvalidCheckpoint,
                                     ("llama.block_count", "layers 0-1 only")),
    "block_count_array": Case(_g(_set("llama.block_count", VT.ARRAY, [2, 2], VT.UINT32)), InvalidCheckpoint,
                              ("llama.block_count", "expected an integer")),
    "block_count_float": Case(_g(_set("llama.block_count", VT.FLOAT32, 2.0)), InvalidCheckpoint,
                              ("llama.block_count", "expected an integer")),
    "block_count_string": Case(_g(_set("llama.block_count", VT.STRING, "2")), InvalidCheckpoint,
                               ("llama.block_count", "expected an integer")),
    "head_count_zero": Case(_g(_set("llama.attention.head_count", VT.UINT32, 0)), InvalidCheckpoint,
                            ("llama.attention.head_count", "= 0")),
    "head_count_kv_not_dividing": Case(_g(_set("llama.attention.head_count_kv", VT.UINT32, 3)), InvalidCheckpoint,
                                       ("head_count", "not a multiple")),
    "hidden_not_heads_multiple": Case(_g(_set("llama.embedding_length", VT.UINT32, 66)), InvalidCheckpoint,
                                      ("embedding_length", "not a multiple")),
    "hidden_mismatch": Case(_g(lambda f: (_set("llama.embedding_length", VT.UINT32, 128)(f), _set(
        "llama.attention.key_length", VT.UINT32, HEAD_DIM)(f))), InvalidCheckpoint, ("has shape", "expected [128")),
    "rope_theta_inf": Case(_g(_set("llama.rope.freq_base", VT.FLOAT32, float("inf"))), InvalidCheckpoint,
                           ("llama.rope.freq_base", "inf", "finite")),
    "rope_theta_nan": Case(_g(_set("llama.rope.freq_base", VT.FLOAT32, float("nan"))), InvalidCheckpoint,
                           ("llama.rope.freq_base", "nan")),
    "rope_theta_negative": Case(_g(_set("llama.rope.freq_base", VT.FLOAT64, -1.0)), InvalidCheckpoint,
                                ("llama.rope.freq_base",)),
    "rms_eps_inf": Case(_g(_set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, float("inf"))),
                        InvalidCheckpoint, ("layer_norm_rms_epsilon", "inf")),
    "rms_eps_zero": Case(_g(_set("llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, 0.0)), InvalidCheckpoint,
                         ("layer_norm_rms_epsilon",)),
    "context_2_40": Case(_g(_set("llama.context_length", VT.UINT64, 2**40)), InvalidCheckpoint,
                         ("llama.context_length", "1099511627776")),
    "bos_past_vocab": Case(_g(_set("tokenizer.ggml.bos_token_id", VT.UINT32, 500)), InvalidCheckpoint,
                           ("tokenizer.ggml.bos_token_id", "500", "[0, 127]")),
    "eos_past_vocab": Case(_g(_set("tokenizer.ggml.eos_token_id", VT.UINT32, 128)), InvalidCheckpoint,
                           ("tokenizer.ggml.eos_token_id", "128")),
    "pad_negative": Case(_g(_set("tokenizer.ggml.padding_token_id", VT.INT32, -1)), InvalidCheckpoint,
                         ("padding_token_id",)),
    "vocab_size_below_rows": Case(_g(_set("llama.vocab_size", VT.UINT32, 100)), InvalidCheckpoint,
                                  ("llama.vocab_size", "100", "128 rows")),
    "tokens_more_than_rows": Case(_g(_set("tokenizer.ggml.tokens", VT.ARRAY, [f"t{i}" for i in range(200)],
                                          VT.STRING)), InvalidCheckpoint, ("200 tokens", "128 rows")),
    "token_type_short": Case(_g(_set("tokenizer.ggml.token_type", VT.ARRAY, [1] * 5, VT.INT32)), InvalidCheckpoint,
                             ("tokenizer.ggml.token_type", "5 entries")),
    "tokens_not_strings": Case(_g(_set("tokenizer.ggml.tokens", VT.ARRAY, list(range(VOCAB)), VT.INT32)),
                               InvalidCheckpoint, ("tokenizer.ggml.tokens", "STRING")),
    "chat_template_int": Case(_g(_set("tokenizer.chat_template", VT.UINT32, 5)), InvalidCheckpoint,
                              ("tokenizer.chat_template", "a string")),
    "embedding_fewer_rows": Case(_g(_tensor("token_embd.weight", dims=(HIDDEN, 100),
                                            data=bytes(HIDDEN * 100 * 4))), InvalidCheckpoint, ("100 rows",)),
    "embedding_1d": Case(_g(_tensor("token_embd.weight", dims=(HIDDEN * VOCAB,))), InvalidCheckpoint,
                         ("token_embd.weight", "2-D")),
    "norm_short": Case(_g(_tensor("blk.1.attn_norm.weight", dims=(32,), data=bytes(128))), InvalidCheckpoint,
                       ("blk.1.attn_norm.weight", "[32]", "[64]")),
    "norm_1elem": Case(_g(_tensor("blk.0.ffn_norm.weight", dims=(1,), data=bytes(4))), InvalidCheckpoint,
                       ("blk.0.ffn_norm.weight", "[1]")),
    "norm_q8_0": Case(_g(_tensor("blk.0.attn_norm.weight", qtype=QT.Q8_0, data=bytes(2 * 34))), InvalidCheckpoint,
                      ("blk.0.attn_norm.weight", "Q8_0", "F32")),
    "outnorm_short": Case(_g(_tensor("output_norm.weight", dims=(16,), data=bytes(64))), InvalidCheckpoint,
                          ("output_norm.weight", "[16]")),
    "weight_transposed": Case(_g(_tensor("blk.0.ffn_down.weight", dims=(HIDDEN, INTER))), InvalidCheckpoint,
                              ("blk.0.ffn_down.weight", "shape")),
    "weight_unreadable_type": Case(_g(_tensor("blk.0.ffn_up.weight", qtype=QT.Q8_1, dims=(HIDDEN, INTER),
                                              data=bytes(INTER * HIDDEN // 32 * GGML_QUANT_SIZES[QT.Q8_1][1]))),
                                   InvalidCheckpoint, ("blk.0.ffn_up.weight", "Q8_1")),
    "ggml_type_unknown": Case(_g(_tensor("blk.0.ffn_up.weight", qtype=99)), InvalidCheckpoint,
                              ("blk.0.ffn_up.weight", "ggml type 99")),
    "rank_5": Case(_g(_tensor("blk.0.ffn_up.weight", dims=(HIDDEN, INTER, 1, 1, 1))), InvalidCheckpoint,
                   ("5 dimensions",)),
    "dim_zero": Case(_g(_tensor("blk.0.ffn_up.weight", dims=(HIDDEN, 0))), InvalidCheckpoint, ("at least 1",)),
    "row_not_whole_blocks": Case(_g(_tensor("blk.0.ffn_up.weight", qtype=QT.Q8_0, dims=(48, INTER))),
                                 InvalidCheckpoint, ("whole blocks",)),
    "dims_product_huge": Case(_g(_tensor("blk.0.ffn_up.weight", dims=(2**31, 2**31))), InvalidCheckpoint,
                              ("runs past the end",)),
    "offset_huge_u64": Case(_g(_tensor("blk.1.ffn_down.weight", offset=2**64 - 32)), InvalidCheckpoint,
                            ("blk.1.ffn_down.weight", "runs past the end")),
    "offset_misaligned": Case(_g(_tensor("blk.1.ffn_down.weight", shift=8)), InvalidCheckpoint,
                              ("blk.1.ffn_down.weight", "alignment")),
    "offset_overlap": Case(_g(_overlap), InvalidCheckpoint, ("overlap",)),
    "rope_scaling_without_factor": Case(_g(_set("llama.rope.scaling.type", VT.STRING, "linear")), InvalidCheckpoint,
                                        ("llama.rope.scaling.factor", "missing")),
    "yarn_log_multiplier": Case(_g(_yarn(("llama.rope.scaling.yarn_log_multiplier", 0.1))), UnsupportedArchitecture,
                                ("llama.rope.scaling.yarn_log_multiplier", "DeepSeek")),
    "yarn_attn_factor": Case(_g(_yarn(("llama.rope.scaling.yarn_attn_factor", 1.2))), UnsupportedArchitecture,
                             ("llama.rope.scaling.yarn_attn_factor",)),
    "yarn_ext_factor": Case(_g(_yarn(("llama.rope.scaling.yarn_ext_factor", 0.5))), UnsupportedArchitecture,
                            ("llama.rope.scaling.yarn_ext_factor",)),
    "yarn_beta_slow_above_fast": Case(_g(_yarn(("llama.rope.scaling.yarn_beta_slow", 64.0))),
                                      UnsupportedArchitecture, ("beta_slow",)),
    "yarn_without_factor": Case(_g(lambda f: [_set(k, t, v)(f) for k, t, v in (
        ("llama.rope.scaling.type", VT.STRING, "yarn"), ("llama.rope.scaling.original_context_length", VT.UINT32,
                                                         32))]), InvalidCheckpoint, ("llama.rope.scaling.factor",
                                                                                      "missing")),
    "yarn_base_1": Case(_g(lambda f: (_yarn()(f), _set("llama.rope.freq_base", VT.FLOAT32, 1.0)(f))),
                        UnsupportedArchitecture, ("llama.rope.freq_base", "above 1")),
    # read for Gemma 3 and gpt-oss only (llama.cpp's set_swa_pattern, its SWA layers' base); elsewhere by name
    "swa_pattern_on_llama": Case(_g(_set("llama.attention.sliding_window_pattern", VT.UINT32, 2)),
                                 UnsupportedArchitecture, ("llama.attention.sliding_window_pattern", "pattern")),
    "swa_rope_base_on_llama": Case(_g(_set("llama.rope.freq_base_swa", VT.FLOAT32, 10.0)), UnsupportedArchitecture,
                                   ("llama.rope.freq_base_swa", "Gemma 3 only")),
    "yarn_beside_rope_freqs": Case(_g(lambda f: (_yarn()(f), f.tensors.append(Tensor(
        "rope_freqs.weight", (HEAD_DIM // 2,), QT.F32, _f32(np.ones(HEAD_DIM // 2)))))), UnsupportedArchitecture,
                                   ("llama.rope.scaling.type", "rope_freqs.weight")),
    "rope_freqs_nan": Case(_g(lambda f: f.tensors.append(Tensor("rope_freqs.weight", (HEAD_DIM // 2,), QT.F32,
                                                                _f32(np.full(HEAD_DIM // 2, np.nan))))),
                           InvalidCheckpoint, ("rope_freqs.weight", "finite")),
    "missing_tensor": Case(_g(lambda f: f.tensors.remove(f.tensor("blk.1.attn_v.weight"))), MissingTensor,
                           ("blk.1.attn_v.weight",)),
    "tensor_not_read": Case(_g(lambda f: f.tensors.append(Tensor("blk.0.ffn_gate_inp.weight", (HIDDEN, 8), QT.F32,
                                                                 bytes(HIDDEN * 8 * 4)))),
                            UnsupportedArchitecture, ("blk.0.ffn_gate_inp.weight", "not read")),
    "global_tensor_not_read": Case(_g(lambda f: f.tensors.append(Tensor("token_types.weight", (HIDDEN, 2), QT.F32,
                                                                        bytes(HIDDEN * 2 * 4)))),
                                   UnsupportedArchitecture, ("token_types.weight",)),
    "layer_past_block_count": Case(_g(lambda f: f.tensors.append(Tensor("blk.2.attn_norm.weight", (64,), QT.F32,
                                                                        bytes(256)))),
                                   InvalidCheckpoint, ("blk.2.attn_norm.weight", "past the config")),
    # 1024 layers x 1024 experts a tensor each (Mixtral's old layout) claimed by a file of a few tensors: 3 M names
    # the check must not build before it finds the first one missing
    "experts_claimed_by_the_million": Case(_g(_claim_experts), MissingTensor, ("blk.0.ffn_gate_inp.weight",)),
    # a dense Llama with a stray expert count reads as a Mixtral: the refusal says which key did that
    "stray_expert_count": Case(_g(lambda f: (_set("llama.expert_count", VT.UINT32, 4)(f),
                                             _set("llama.expert_used_count", VT.UINT32, 2)(f))), MissingTensor,
                               ("blk.0.ffn_gate_inp.weight", "llama.expert_count = 4", "Mixtral")),
}


def _h(config=None, shards=None, extra=None) -> Callable[[Path], Path]:
    return lambda d: write_hf(d / "hf", config, shards, extra)


def _cfg(**changes) -> dict:
    c = tiny_hf_config()
    for k, v in changes.items():
        if v is ...:
            c.pop(k)
        else:
            c[k] = v
    return c


def _weights(**changes) -> dict[str, np.ndarray]:
    w = tiny_weights()
    for k, v in changes.items():
        name = k.replace("__", ".")
        if v is None:
            w.pop(name)
        else:
            w[name] = v
    return w


def _two_shards(d: Path) -> Path:
    w = tiny_weights()
    names = list(w)
    a = {n: w[n] for n in names[:10]}
    b = {n: w[n] for n in names[9:]}  # names[9] in both
    return write_hf(d / "hf", shards={"model-00001-of-00002.safetensors": safetensors_bytes(a),
                                      "model-00002-of-00002.safetensors": safetensors_bytes(b)})


def _lying_header(n: int) -> Callable[[Path], Path]:
    def build(d: Path) -> Path:
        data = bytearray(safetensors_bytes(tiny_weights()))
        data[:8] = struct.pack("<Q", n)
        return write_hf(d / "hf", shards={"model.safetensors": bytes(data)})
    return build


def _offsets(edit: Callable[[dict], None]) -> Callable[[Path], Path]:
    return _h(shards={"model.safetensors": safetensors_bytes(tiny_weights(), edit)})


def _indexed(weight_map_edit: Callable[[dict], None], other: bool) -> Callable[[Path], Path]:
    """Shards listed by a model.safetensors.index.json whose weight_map the case edits; ``other``: a second shard
    also holds model.norm.weight."""
    def build(d: Path) -> Path:
        w = tiny_weights()
        index = {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in w}}
        weight_map_edit(index["weight_map"])
        extra = {"model.safetensors.index.json": json.dumps(index).encode()}
        if other:
            extra["other.safetensors"] = safetensors_bytes({"model.norm.weight": w["model.norm.weight"]})
        return write_hf(d / "hf", shards={"model-00001-of-00001.safetensors": safetensors_bytes(w)}, extra=extra)
    return build


HF_CASES: dict[str, Case] = {
    "config_list": Case(_h(config="[1, 2, 3]"), InvalidCheckpoint, ("config.json", "list")),
    "config_not_json": Case(_h(config="model_type: llama"), InvalidCheckpoint, ("config.json", "not valid JSON")),
    "config_empty": Case(_h(config=""), InvalidCheckpoint, ("config.json", "not valid JSON")),
    "config_not_utf8": Case(_h(config=b'{"model_type": "\xff"}'), InvalidCheckpoint, ("config.json", "UTF-8")),
    "config_nested_1e5": Case(_h(config='{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"), InvalidCheckpoint,
                              ("config.json", "100001 levels")),
    "config_2mb": Case(_h(config=json.dumps({**tiny_hf_config(), "pad": "x" * (2 << 20)})), InvalidCheckpoint,
                       ("config.json", "bytes")),
    "config_duplicate_key": Case(_h(config=json.dumps(tiny_hf_config())[:-1] + ', "hidden_size": 32}'),
                                 InvalidCheckpoint, ("hidden_size", "twice")),
    "heads_zero": Case(_h(config=_cfg(num_attention_heads=0)), InvalidCheckpoint, ("num_attention_heads", "= 0")),
    "heads_bool": Case(_h(config=_cfg(num_attention_heads=True)), InvalidCheckpoint, ("num_attention_heads", "True")),
    "hidden_string": Case(_h(config=_cfg(hidden_size="64")), InvalidCheckpoint, ("hidden_size", "'64'")),
    "hidden_float": Case(_h(config=_cfg(hidden_size=64.0)), InvalidCheckpoint, ("hidden_size", "64.0")),
    "hidden_missing": Case(_h(config=_cfg(hidden_size=...)), InvalidCheckpoint, ("hidden_size", "missing")),
    "kv_heads_not_dividing": Case(_h(config=_cfg(num_key_value_heads=3)), InvalidCheckpoint, ("not a multiple",)),
    "layers_past_tensors": Case(_h(config=_cfg(num_hidden_layers=40)), InvalidCheckpoint,
                                ("num_hidden_layers", "layers 0-1 only")),
    "layers_1e9": Case(_h(config=_cfg(num_hidden_layers=10**9)), InvalidCheckpoint, ("num_hidden_layers",)),
    "rope_theta_nan": Case(_h(config='{"rope_theta": NaN, ' + json.dumps(_cfg(rope_theta=...))[1:]),
                           InvalidCheckpoint, ("rope_theta", "nan")),
    "rope_theta_inf": Case(_h(config='{"rope_theta": Infinity, ' + json.dumps(_cfg(rope_theta=...))[1:]),
                           InvalidCheckpoint, ("rope_theta", "inf")),
    "rms_eps_negative": Case(_h(config=_cfg(rms_norm_eps=-1e-5)), InvalidCheckpoint, ("rms_norm_eps",)),
    "rope_scaling_without_factor": Case(_h(config=_cfg(rope_scaling={"rope_type": "linear"})), InvalidCheckpoint,
                                        ("rope_scaling", "factor")),
    "rope_scaling_list": Case(_h(config=_cfg(rope_scaling=[1, 2])), InvalidCheckpoint, ("rope_scaling",)),
    "rope_factor_string": Case(_h(config=_cfg(rope_scaling={"rope_type": "linear", "factor": "8"})),
                               InvalidCheckpoint, ("rope_scaling.factor",)),
    "context_2_40": Case(_h(config=_cfg(max_position_embeddings=2**40)), InvalidCheckpoint,
                         ("max_position_embeddings",)),
    "eos_past_vocab": Case(_h(config=_cfg(eos_token_id=128)), InvalidCheckpoint, ("eos_token_id", "128")),
    "eos_list_bad": Case(_h(config=_cfg(eos_token_id=[2, -5])), InvalidCheckpoint, ("eos_token_id",)),
    "bos_past_vocab": Case(_h(config=_cfg(bos_token_id=4000)), InvalidCheckpoint, ("bos_token_id",)),
    "vocab_below_rows": Case(_h(config=_cfg(vocab_size=100)), InvalidCheckpoint, ("vocab_size", "128 rows")),
    "shard_empty": Case(_h(shards={"model.safetensors": b""}), InvalidCheckpoint, ("model.safetensors", "too short")),
    "shard_truncated": Case(_h(shards={"model.safetensors": safetensors_bytes(tiny_weights())[:5000]}),
                            InvalidCheckpoint, ("model.safetensors",)),
    "shard_truncated_in_data": Case(_h(shards={"model.safetensors": safetensors_bytes(tiny_weights())[:-100]}),
                                    InvalidCheckpoint, ("model.safetensors", "not a valid safetensors")),
    "shard_header_length_lies": Case(_lying_header(10**6), InvalidCheckpoint, ("model.safetensors", "truncated")),
    "shard_header_length_huge": Case(_lying_header(2**62), InvalidCheckpoint, ("model.safetensors",)),
    "shard_header_not_json": Case(_h(shards={"model.safetensors": struct.pack("<Q", 16) + b"not json at all!"}),
                                  InvalidCheckpoint, ("model.safetensors", "not a valid safetensors")),
    "shard_offset_outside": Case(_offsets(lambda h: h["model.norm.weight"].update(data_offsets=[0, 10**9])),
                                 InvalidCheckpoint, ("model.safetensors",)),
    "shard_offsets_overlap": Case(_offsets(lambda h: h["model.layers.0.input_layernorm.weight"].update(
        data_offsets=h["model.norm.weight"]["data_offsets"])), InvalidCheckpoint, ("model.safetensors",)),
    "shard_dtype_unknown": Case(_offsets(lambda h: h["model.norm.weight"].update(dtype="F33")), InvalidCheckpoint,
                                ("model.safetensors",)),
    "shard_nested_header": Case(_offsets(lambda h: h.update(__metadata__={"x": [[[[[[[[1]]]]]]]]})),
                                InvalidCheckpoint, ("model.safetensors",)),
    "tensor_in_two_shards": Case(_two_shards, InvalidCheckpoint, ("also in",)),
    "index_and_a_second_shard": Case(_indexed(lambda m: m.update({"model.norm.weight": "other.safetensors"}), True),
                                     InvalidCheckpoint, ("model.norm.weight", "also in")),
    "index_names_a_tensor_no_shard_holds": Case(_indexed(lambda m: m.update({"model.extra.weight": m[
        "model.norm.weight"]}), False), MissingTensor, ("model.extra.weight", "does not hold it")),
    "index_names_a_missing_shard": Case(_indexed(lambda m: m.update({"model.norm.weight": "gone.safetensors"}),
                                                 False), MissingTensor, ("gone.safetensors",)),
    "index_with_a_path": Case(_indexed(lambda m: m.update({"model.norm.weight": "../x.safetensors"}), False),
                              InvalidCheckpoint, ("weight_map",)),
    "no_shard": Case(_h(shards={}), MissingTensor, ("no *.safetensors",)),
    "norm_short": Case(_h(shards={"model.safetensors": safetensors_bytes(_weights(
        model__layers__1__input_layernorm__weight=np.ones(32, np.float32)))}), InvalidCheckpoint,
        ("model.layers.1.input_layernorm.weight", "[32]", "[64]")),
    "norm_1elem": Case(_h(shards={"model.safetensors": safetensors_bytes(_weights(
        model__norm__weight=np.ones(1, np.float32)))}), InvalidCheckpoint, ("model.norm.weight", "[1]")),
    "weight_int32": Case(_h(shards={"model.safetensors": safetensors_bytes(_weights(
        model__layers__0__mlp__up_proj__weight=np.zeros((INTER, HIDDEN), np.int32)))}), InvalidCheckpoint,
        ("mlp.up_proj.weight", "I32")),
    "missing_tensor": Case(_h(shards={"model.safetensors": safetensors_bytes(_weights(
        model__layers__1__mlp__down_proj__weight=None))}), MissingTensor, ("model.layers.1.mlp.down_proj.weight",)),
    "lm_head_while_tied": Case(_h(shards={"model.safetensors": safetensors_bytes(_weights(
        lm_head__weight=np.zeros((VOCAB, HIDDEN), np.float32)))}), UnsupportedArchitecture, ("lm_head.weight",)),
}
