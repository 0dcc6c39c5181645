"""A model file is untrusted input: one pass over a checkpoint's description, in the coordinator, before any stage
starts or anything is allocated. ``check_checkpoint(path)`` returns the ``ModelConfig`` it describes, or raises
one error naming the file, the key or tensor, the value found and what was expected.

What it holds the checkpoint to (the README's "What a checkpoint must satisfy" lists it for users):

1. The container: a GGUF header (``ringshm.model.gguf_index``) or an HF directory's ``config.json`` and
   safetensors headers (``ringshm.model.hf_index``), read with every count and length bounded by the file and
   by caps, so that a hostile header is refused in bounded time and memory.
2. Every metadata value ringshm or its tokenizer reads has its type and range (``ringshm.model.metadata_rules``):
   integers where integers (a bool, a float or an array is not one), finite numbers (NaN and inf are refused),
   counts and widths between 1 and a cap, the context length at most ``MAX_CONTEXT``, heads dividing, token
   ids inside the vocabulary, required keys present.
3. The tensors are exactly what the family description reads (``expected_tensors``): each present, of a type
   it can read (norms and biases F32 / F16 / BF16 with exactly their width of elements: a norm must hold
   ``hidden`` values, not fewer, and not as Q8_0), of the shape the config implies; a tensor it would not read
   is refused (``UnsupportedArchitecture``), as is a layer the config does not count. Where a tensor lies in
   the file (offset, size, alignment, overlaps) is the container's check (1).
4. One vocabulary: the embedding's rows are the vocabulary size (they size the reply ring and the LM head), and
   the metadata's ``vocab_size`` and the GGUF tokenizer's token list must be that size.

Everything here reads the header and metadata only (and the 64 floats of a Llama 3 ``rope_freqs.weight``), and
imports no torch: the CLI runs it before torch loads.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringshm.errors import InvalidCheckpoint, MissingTensor, RingshmError, UnsupportedArchitecture
from ringshm.model import families, families_gguf, families_hf
from ringshm.model.gguf_index import GGUFIndex
from ringshm.model.hf_index import HFIndex
from ringshm.model.metadata_rules import (
    GGUF_REQUIRED,
    GGUF_RULES,
    HF_REQUIRED,
    HF_RULES,
    MAX_HEAD_DIM,
    MAX_VOCAB,
    SHOW,
    TOKEN_ID_KEY,
    TOKENIZER_ARRAYS,
    TOKENIZER_RULES,
    bad_value,
    int_in,
)
from ringshm.model_config import ModelConfig

FLOATS = ("F32", "F16", "BF16")  # the types a norm, bias or (HF) weight may have

@dataclass(frozen=True)
class CheckedCheckpoint:
    """A checkpoint that passed: its path, whether it is a GGUF file, its index (``GGUFIndex`` or ``HFIndex``) and
    the ``ModelConfig`` it describes."""

    path: Path
    gguf: bool
    index: GGUFIndex | HFIndex
    config: ModelConfig


def check_checkpoint(path: str | Path) -> CheckedCheckpoint:
    """Check the ``.gguf`` file or HF directory at ``path`` (module docstring) and return what it describes.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is neither a ``.gguf`` file nor a directory with
            ``config.json`` (the message says which).
        InvalidCheckpoint: a value, count, length or tensor breaks a rule (``MissingTensor``, a subclass: a
            tensor the description reads is absent).
        UnsupportedArchitecture: a valid checkpoint of a model ringshm does not compute (by name).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        index = GGUFIndex.open(path)
        return CheckedCheckpoint(path, True, index, check_gguf(index))
    if path.is_dir() and (path / "config.json").is_file():
        index = HFIndex.open(path)
        return CheckedCheckpoint(path, False, index, check_hf(index))
    raise FileNotFoundError(f"model path {path} is neither a .gguf file nor a directory with config.json")


def _wrap_family_errors(fn, where: str, *args) -> ModelConfig:
    """``fn(*args)`` (a families reader); a ``ValueError`` it raises that is not one of ringshm's own (the config's
    own range checks) becomes an InvalidCheckpoint naming ``where``."""
    try:
        return fn(*args)
    except RingshmError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidCheckpoint(f"{where}: {exc}") from None


# ------------------------------------------------------------------------------------------------ GGUF
def check_gguf(index: GGUFIndex) -> ModelConfig:
    """The ``ModelConfig`` of a GGUF file whose header ``index`` read, after rules 2-4 of the module docstring.

    Raises:
        InvalidCheckpoint, MissingTensor, UnsupportedArchitecture: as ``check_checkpoint``.
    """
    where, meta = str(index.path), index.meta

    def label(key: str) -> str:
        return f"{where}: metadata {key!r}"

    def value(key: str):
        if key in index.array_lengths:
            raise InvalidCheckpoint(f"{label(key)} is an array of {index.array_lengths[key]} "
                                    f"{index.array_types[key]}: expected one value")
        return meta.get(key)

    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise bad_value(label("general.architecture"), arch, "the architecture's name (a string)")
    if arch not in families.GGUF_ARCHS.values():
        families_gguf.gguf_config({}, set(), arch, where, 1, None)  # raises UnsupportedArchitecture naming it
    for key, rule in GGUF_RULES.items():
        full = f"{arch}.{key}"
        if full in meta:
            rule(label(full), meta[full])
        elif full in index.array_lengths:
            value(full)  # an array too long to hold a value ringshm reads: refused, naming it
        elif key in GGUF_REQUIRED:
            raise InvalidCheckpoint(f"{label(full)} is missing: a {arch} checkpoint must say it")
    for key, rule in TOKENIZER_RULES.items():
        if key in meta:
            rule(label(key), meta[key])
        elif key in index.array_lengths:
            value(key)
    for key, etype in TOKENIZER_ARRAYS.items():
        if key in meta and key not in index.array_lengths:
            raise bad_value(label(key), meta[key], f"an array of {etype}")
        if key in index.array_types and index.array_types[key] != etype:
            raise InvalidCheckpoint(f"{label(key)} is an array of {index.array_types[key]}: expected {etype}")

    embed = index.tensors.get("token_embd.weight")
    if embed is None:
        raise MissingTensor(f"{where}: tensor 'token_embd.weight' (the token embedding) not found")
    if len(embed.shape) != 2:
        raise InvalidCheckpoint(f"{where}: tensor 'token_embd.weight' has shape {list(embed.shape)}: expected 2-D "
                                f"[hidden, vocab] (GGUF order)")
    vocab = embed.shape[1]
    if not 1 <= vocab <= MAX_VOCAB:
        raise bad_value(f"{where}: tensor 'token_embd.weight''s rows (the vocabulary)", vocab, f"1 to {MAX_VOCAB}")
    for key in (f"{arch}.vocab_size",):
        if key in meta and meta[key] != vocab:
            raise InvalidCheckpoint(f"{label(key)} = {meta[key]} but token_embd.weight has {vocab} rows: the "
                                    f"embedding's rows are the vocabulary")
    n_tokens = index.array_lengths.get("tokenizer.ggml.tokens")
    if n_tokens is not None:
        if n_tokens != vocab:
            raise InvalidCheckpoint(f"{label('tokenizer.ggml.tokens')} holds {n_tokens} tokens but token_embd.weight "
                                    f"has {vocab} rows: the tokenizer and the embedding must agree")
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key in index.array_lengths and index.array_lengths[key] != n_tokens:
                raise InvalidCheckpoint(f"{label(key)} holds {index.array_lengths[key]} entries: expected one per "
                                        f"token, {n_tokens}")
    for key in sorted(k for k in meta if TOKEN_ID_KEY.fullmatch(k)):
        int_in(0, vocab - 1)(label(key), value(key))

    p = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads, n_kv = p("attention.head_count"), p("attention.head_count_kv", p("attention.head_count"))
    if n_heads % n_kv:
        raise InvalidCheckpoint(f"{label(f'{arch}.attention.head_count')} = {n_heads} is not a multiple of "
                                f"{arch}.attention.head_count_kv = {n_kv}: each KV head serves a whole group")
    if p("attention.key_length") is None and p("embedding_length") % n_heads:
        raise InvalidCheckpoint(f"{label(f'{arch}.embedding_length')} = {p('embedding_length')} is not a multiple "
                                f"of {arch}.attention.head_count = {n_heads}, and no attention.key_length says the "
                                f"head width")
    head_dim = p("attention.key_length", p("embedding_length") // n_heads)
    if head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise bad_value(f"{where}: the head width ({arch}.attention.key_length, or embedding_length / head_count)",
                   head_dim, f"an even number <= {MAX_HEAD_DIM}")
    if p("rope.scaling.type") in ("linear", "yarn") and p("rope.scaling.factor") is None:
        raise InvalidCheckpoint(f"{label(f'{arch}.rope.scaling.factor')} is missing: rope.scaling.type "
                                f"{p('rope.scaling.type')!r} needs it")
    pattern = p("attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) != p("block_count"):
        raise InvalidCheckpoint(f"{label(f'{arch}.attention.sliding_window_pattern')} holds {len(pattern)} flags: "
                                f"expected one per layer, {p('block_count')}")
    _check_layer_count(where, f"metadata '{arch}.block_count'", p("block_count"), index.tensors, "blk.")

    rope_freqs = None
    if "rope_freqs.weight" in index.tensors:
        t = index.tensors["rope_freqs.weight"]
        if t.qtype != 0 or t.shape != (head_dim // 2,):
            raise InvalidCheckpoint(f"{where}: tensor 'rope_freqs.weight' is type {_type_name(t.qtype)} shape "
                                    f"{list(t.shape)}: expected F32 [{head_dim // 2}] (head_dim / 2)")
        rope_freqs = np.frombuffer(index.raw("rope_freqs.weight"), dtype="<f4").tolist()
        if not all(math.isfinite(x) and x > 0 for x in rope_freqs):
            raise InvalidCheckpoint(f"{where}: tensor 'rope_freqs.weight' holds {SHOW.repr(rope_freqs)}: expected "
                                    f"finite factors > 0")
    keys = dict(meta)
    keys.update({k: None for k in index.array_lengths if k not in keys})  # long arrays are audited by name
    cfg = _wrap_family_errors(families_gguf.gguf_config, where, keys, set(index.tensors), arch, where, vocab,
                              rope_freqs)
    _check_tensors(where, cfg, True, {n: (_type_name(t.qtype), tuple(reversed(t.shape))) for n, t in
                                     index.tensors.items()})
    return cfg


NATIVE_GGUF_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K",
                               "MXFP4"})


@functools.cache
def readable_gguf_type(name: str) -> bool:
    """Whether the loader reads GGUF weights of type ``name``: in their encoding (``NATIVE_GGUF_TYPES``, the C
    matmul's), or dequantized by ``gguf.quants`` (Q2_K, Q3_K, the IQ types: one block of zeros tells)."""
    if name in NATIVE_GGUF_TYPES:
        return True
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    try:
        qt = GGMLQuantizationType[name]
        quants.dequantize(np.zeros(GGML_QUANT_SIZES[qt][1], dtype=np.uint8), qt)
    except (KeyError, NotImplementedError, ValueError):
        return False
    return True


def _type_name(qtype: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"ggml type {qtype}"


# -------------------------------------------------------------------------------------------------- HF
def check_hf(index: HFIndex) -> ModelConfig:
    """The ``ModelConfig`` of an HF directory whose ``config.json`` and shard headers ``index`` read, after rules
    2-4 of the module docstring.

    Raises:
        InvalidCheckpoint, MissingTensor, UnsupportedArchitecture: as ``check_checkpoint``.
    """
    c = index.config
    where = str(index.path / "config.json")
    for key in HF_REQUIRED:
        if key not in c:
            raise InvalidCheckpoint(f"{where}: {key!r} is missing: a config must say it")
    HF_RULES["model_type"](f"{where}: 'model_type'", c["model_type"])
    if c["model_type"] not in families.HF_TYPES:
        families_hf.hf_config(c, where)  # raises UnsupportedArchitecture naming it
    for key, rule in HF_RULES.items():
        if key in c:
            rule(f"{where}: {key!r}", c[key])
    vocab = c["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = c.get(key)
        for t in ids if isinstance(ids, list) else [ids]:
            if t is not None and t >= vocab:
                raise InvalidCheckpoint(f"{where}: {key!r} = {ids}: a token id must be below vocab_size {vocab}")
    n_heads, n_kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    if n_heads % n_kv:
        raise InvalidCheckpoint(f"{where}: 'num_attention_heads' = {n_heads} is not a multiple of "
                                f"'num_key_value_heads' = {n_kv}: each KV head serves a whole group")
    if not c.get("head_dim") and c["hidden_size"] % n_heads:
        raise InvalidCheckpoint(f"{where}: 'hidden_size' = {c['hidden_size']} is not a multiple of "
                                f"'num_attention_heads' = {n_heads}, and no 'head_dim' says the head width")
    head_dim = c.get("head_dim") or c["hidden_size"] // n_heads
    if head_dim % 2:
        raise bad_value(f"{where}: the head width ('head_dim', or hidden_size / num_attention_heads)", head_dim,
                   "an even number")
    _check_layer_count(where, "'num_hidden_layers'", c["num_hidden_layers"], index.tensors, "model.layers.")
    cfg = _wrap_family_errors(families_hf.hf_config, where, c, where)
    embed = index.tensors.get(families.GLOBAL_TENSORS["embed"][1])
    if embed is not None and len(embed.shape) == 2 and embed.shape[0] != vocab:
        raise InvalidCheckpoint(f"{where}: 'vocab_size' = {vocab} but model.embed_tokens.weight has {embed.shape[0]} "
                                f"rows: the embedding's rows are the vocabulary")
    mxfp4 = families_hf.hf_mxfp4(c)
    if mxfp4 and (cfg.hidden % 32 or cfg.expert_intermediate % 32):
        raise InvalidCheckpoint(f"{where}: quantization_config mxfp4 with hidden_size {cfg.hidden} and "
                                f"intermediate_size {cfg.expert_intermediate}: MXFP4 blocks need multiples of 32")
    _check_tensors(str(index.path), cfg, False, {n: (t.dtype, t.shape) for n, t in index.tensors.items()},
                   hf_mxfp4=mxfp4)
    return cfg


# -------------------------------------------------------------------------------------------- tensors
@dataclass(frozen=True)
class Expect:
    """What the description reads under one tensor name: its shape (torch order, outermost first), whether it is
    a matmul weight (any type the loader reads) or a vector (norm, bias: floats only), and what it is for."""

    shape: tuple[int, ...]
    weight: bool
    what: str
    types: tuple[str, ...] = ()  # the types it may have, where not the weight / vector rule (MXFP4 blocks: U8)


def expected_tensors(cfg: ModelConfig, gguf: bool, rope_freqs: bool = False,
                     merged_gate_up_exps: bool = False, split_experts: bool = False,
                     hf_mxfp4: bool = False) -> Iterator[tuple[str, Expect]]:
    """Every tensor the family description of ``cfg`` reads, by its GGUF (``gguf``) or HF name, with its shape, one
    ``(name, Expect)`` at a time, each name once: a caller that stops at the first name a checkpoint lacks does work
    bounded by the checkpoint's own tensor count, whatever layer and expert counts its metadata claims.

    Layer ``i``'s fields are ``families.TENSOR_NAMES[cfg.arch]`` that ``families.wanted`` keeps; fused Phi-3
    tensors are ``[q + 2 kv, hidden]`` and ``[2 I, hidden]``; the LM head only when not tied; GGUF's
    ``rope_freqs.weight`` ``[head_dim / 2]`` when ``rope_freqs``. Routed experts (``cfg.moe``): the router
    ``[E, hidden]``; in GGUF ``[E, I_e, hidden]`` gate and up (or, ``merged_gate_up_exps``, one
    ``ffn_gate_up_exps`` ``[E, 2 I_e, hidden]``, with gpt-oss's biases ``ffn_gate_up_exps.bias`` ``[E, 2 I_e]``) and
    ``[E, hidden, I_e]`` down, or (``split_experts``: files from
    before llama.cpp stacked them) one 2-D tensor per expert, ``ffn_gate.{e}.weight`` ...; in HF one 2-D tensor per
    expert, or (Granite MoE) ``input_linear`` ``[E, 2 I_e, hidden]`` and ``output_linear`` ``[E, hidden, I_e]``. A
    shared expert (width S): gate and up ``[S, hidden]``, down ``[hidden, S]``, its gate's weights ``[hidden]``
    (``_check_tensors`` also takes the ``[1, hidden]`` of an HF linear layer or a converter that kept it 2-D).
    gpt-oss's HF experts: ``gate_up_proj`` ``[E, hidden, 2 I_e]`` and ``down_proj`` ``[E, I_e, hidden]``, or
    (``hf_mxfp4``) each as U8 ``_blocks`` ``[E, rows, cols / 32, 16]`` and ``_scales`` ``[E, rows, cols / 32]``
    (``families.HF_MXFP4_SUFFIXES``), rows ``2 I_e`` and ``hidden``.
    """
    h, q, kv, inter, d = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.intermediate, cfg.head_dim
    n_e, ie, si = cfg.n_experts, cfg.expert_intermediate, cfg.shared_expert_intermediate
    names = families.TENSOR_NAMES[cfg.arch]
    shapes = {
        "attn_norm": (h,), "ffn_norm": (h,), "post_attn_norm": (h,), "post_ffn_norm": (h,),
        "q_norm": (q,) if cfg.qk_norm_full else (d,), "k_norm": (kv,) if cfg.qk_norm_full else (d,),
        "w_router": (n_e, h), "w_exp_gate": (n_e, ie, h), "w_exp_up": (n_e, ie, h), "w_exp_down": (n_e, h, ie),
        "w_shexp_gate": (si, h), "w_shexp_up": (si, h), "w_shexp_down": (h, si), "shexp_gate_inp": (h,),
        "wq": (q + 2 * kv if names.fused_qkv else q, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, q),
        "w_gate": (2 * inter if names.fused_gate_up else inter, h), "w_up": (inter, h), "w_down": (h, inter),
        "bq": (q,), "bk": (kv,), "bv": (kv,), "bo": (h,), "b_gate": (2 * inter if names.fused_gate_up else inter,),
        "b_up": (inter,), "b_down": (h,), "sinks": (cfg.n_heads,), "b_router": (n_e,), "b_exp_gate": (n_e, ie),
        "b_exp_up": (n_e, ie), "b_exp_down": (n_e, h),
    }
    side = 0 if gguf else 1
    for i in range(cfg.n_layers):
        prefix = f"blk.{i}." if gguf else f"model.layers.{i}."
        for field, pair in names.layer.items():
            if not families.wanted(cfg, field, names):
                continue
            what = f"layer {i} {field}"
            if field in (*families.EXPERT_FIELDS, "b_exp_gate", "b_exp_up", "b_exp_down") and not gguf and \
                    names.hf_transposed_experts:  # gpt-oss: [E, in, out], gate | up columns interleaved in one
                fused = {"w_exp_gate": (n_e, h, 2 * ie), "w_exp_down": (n_e, ie, h), "b_exp_gate": (n_e, 2 * ie),
                         "b_exp_down": (n_e, h)}
                what = f"layer {i} " + (field.replace("_gate", "_gate_up") if field.endswith("_gate") else field)
                if field in ("w_exp_gate", "w_exp_down") and hf_mxfp4:  # [E, rows, cols / 32, 16] and [.., cols / 32]
                    rows, cols = (2 * ie, h) if field == "w_exp_gate" else (h, ie)
                    yield prefix + pair[1] + "_blocks", Expect((n_e, rows, cols // 32, 16), True, what + " blocks",
                                                                ("U8",))
                    yield prefix + pair[1] + "_scales", Expect((n_e, rows, cols // 32), True, what + " scales",
                                                                ("U8",))
                elif field in fused:
                    yield prefix + pair[1], Expect(fused[field], field.startswith("w"), what)
            elif field in families.EXPERT_FIELDS and not gguf and names.hf_fused_experts:  # 3-D, gate | up in one
                if field != "w_exp_up":
                    shape = (n_e, 2 * ie, h) if field == "w_exp_gate" else shapes[field]
                    yield prefix + pair[1], Expect(shape, True, f"layer {i} "
                                                   f"{'w_exp_gate_up' if field == 'w_exp_gate' else field}")
            elif field in families.EXPERT_FIELDS and (not gguf or split_experts):  # one [rows, cols] per expert
                name = pair[1] if not gguf else families.GGUF_SPLIT_EXPERTS[field]
                for e in range(n_e):
                    yield prefix + name.format(e=e), Expect(shapes[field][1:], True, f"{what} expert {e}")
            elif field in ("w_shexp_gate", "w_shexp_up") and not gguf and names.hf_fused_shexp:  # [gate | up]
                if field == "w_shexp_gate":
                    yield prefix + pair[1], Expect((2 * si, h), True, f"layer {i} w_shexp_gate_up")
            elif field in ("w_exp_gate", "w_exp_up") and merged_gate_up_exps:
                if field == "w_exp_gate":
                    yield prefix + families.GGUF_MERGED_GATE_UP_EXPS, Expect((n_e, 2 * ie, h), True,
                                                                             f"layer {i} w_exp_gate_up")
            elif field in ("b_exp_gate", "b_exp_up") and merged_gate_up_exps:
                if field == "b_exp_gate":
                    yield prefix + families.GGUF_MERGED_GATE_UP_EXPS_BIAS, Expect((n_e, 2 * ie), False,
                                                                                  f"layer {i} b_exp_gate_up")
            else:
                yield prefix + pair[side], Expect(shapes[field], field.startswith("w"), what)
    roles = {role: pair[side] for role, pair in families.GLOBAL_TENSORS.items()}
    yield roles["embed"], Expect((cfg.vocab, h), True, "token embedding")
    yield roles["norm"], Expect((h,), False, "final norm")
    if not cfg.tie_embeddings:
        yield roles["lm_head"], Expect((cfg.vocab, h), True, "LM head")
    if rope_freqs:
        yield "rope_freqs.weight", Expect((d // 2,), False, "Llama 3 RoPE frequency factors")


def _check_layer_count(where: str, label: str, n_layers: int, tensors, prefix: str) -> None:
    """``n_layers`` may not exceed the layers the file holds tensors for."""
    found = {int(m.group(1)) for n in tensors if (m := re.match(re.escape(prefix) + r"(\d+)\.", n))}
    held = max(found) + 1 if found else 0
    if n_layers > held:
        raise InvalidCheckpoint(f"{where}: {label} = {n_layers} but the file holds tensors for "
                                + (f"layers 0-{held - 1} only" if held else "no layer"))


# vectors a checkpoint may hold as one row (a Linear(hidden, 1) weight): the shared expert's gate
ONE_ROW_VECTORS = (families.TENSOR_NAMES["qwen2moe"].layer["shexp_gate_inp"][0],
                   families.TENSOR_NAMES["qwen2moe"].layer["shexp_gate_inp"][1])


def _check_one_type_per_role(where: str, want: dict[str, Expect], found: dict) -> None:
    """One layer's experts of one role, held as a tensor each (HF, older GGUF), must share one type: the matmul
    packs a role's experts alike, and would widen every one of them to F32 for one odd expert."""
    first: dict[str, tuple[str, str]] = {}
    for name, e in want.items():
        role, sep, _ = e.what.rpartition(" expert ")
        if not sep:
            continue
        tname = found[name][0]
        seen = first.setdefault(role, (name, tname))
        if seen[1] != tname:
            raise InvalidCheckpoint(f"{where}: tensor {name!r} ({e.what}) is {tname} but {seen[0]!r} is {seen[1]}: "
                                    f"one type for every expert of a role")


def _other_expert_layout(name: str, found: dict) -> bool:
    """Whether the GGUF layer of the missing expert tensor ``name`` holds routed experts in the other layout: one 2-D
    ``ffn_*.{e}`` per expert where ``name`` is 3-D (``ffn_*_exps``, ``ffn_gate_up_exps``), or the reverse."""
    layer = re.match(r"blk\.\d+\.", name)
    split = re.compile(r"ffn_(?:gate|up|down)\.\d+\.weight$")
    stacked = re.compile(r"ffn_(?:gate|up|down|gate_up)_exps\.weight$")
    other = stacked if split.search(name) else split
    return bool(layer) and any(n.startswith(layer.group(0)) and other.search(n) for n in found)


def _check_tensors(where: str, cfg: ModelConfig, gguf: bool, found: dict[str, tuple[str, tuple[int, ...]]],
                   hf_mxfp4: bool = False) -> None:
    """Every tensor of ``found`` (name -> (type name, torch-order shape)) against ``expected_tensors``."""
    merged = gguf and cfg.moe and f"blk.0.{families.GGUF_MERGED_GATE_UP_EXPS}" in found
    split = gguf and cfg.arch == "mixtral" and "blk.0." + families.GGUF_SPLIT_EXPERTS["w_exp_gate"].format(e=0) in found
    want: dict[str, Expect] = {}
    for name, e in expected_tensors(cfg, gguf, rope_freqs=gguf and "rope_freqs.weight" in found,
                                    merged_gate_up_exps=merged, split_experts=split, hf_mxfp4=hf_mxfp4):
        if name not in found:  # first: a hostile layer x expert count costs at most the file's tensor count
            why = (f" (the file's llama.expert_count = {cfg.n_experts} makes it a Mixtral, whose every layer routes "
                   f"experts)" if gguf and cfg.arch == "mixtral" and e.what.endswith("w_router") else "")
            if gguf and cfg.moe and "w_exp_" in e.what and _other_expert_layout(name, found):
                why = " (its layer stores its experts in another layout than layer 0's: one layout a file)"
            raise MissingTensor(f"{where}: tensor {name!r} ({e.what}) not found{why}")
        want[name] = e
        tname, shape = found[name]
        if shape != e.shape and not (name.endswith(ONE_ROW_VECTORS) and shape == (1, *e.shape)):
            raise InvalidCheckpoint(f"{where}: tensor {name!r} ({e.what}) has shape {list(shape)}: expected "
                                    f"{list(e.shape)} (torch order) for this config")
        ok = tname in e.types if e.types else (readable_gguf_type(tname) if gguf else tname in FLOATS) if e.weight \
            else tname in FLOATS
        if not ok:
            kind = "norm" if "norm" in e.what else "gate" if "gate_inp" in e.what else "bias"
            expected = " or ".join(e.types) if e.types else ("a type the loader dequantizes" if gguf else
                                                              "F32, F16 or BF16") if e.weight else \
                f"{', '.join(FLOATS)} ({kind} values are read as floats)"
            raise InvalidCheckpoint(f"{where}: tensor {name!r} ({e.what}) is {tname}: expected {expected}")
    _check_one_type_per_role(where, want, found)
    for i in range(cfg.n_layers):  # the shared expert's gate and up are packed as one matmul: one type
        gate, up = (f"blk.{i}.ffn_{r}_shexp.weight" for r in ("gate", "up"))
        if gguf and gate in want and up in want and found[gate][0] != found[up][0]:
            raise InvalidCheckpoint(f"{where}: tensor {up!r} is {found[up][0]} but {gate!r} is {found[gate][0]}: the "
                                    f"shared expert's gate and up in one type")
    extra = sorted(set(found) - set(want))
    if extra:
        layer_of = re.compile(r"(?:blk|model\.layers)\.(\d+)\.")
        beyond = [n for n in extra if (m := layer_of.match(n)) and int(m.group(1)) >= cfg.n_layers]
        if beyond:
            raise InvalidCheckpoint(f"{where}: tensor {beyond[0]!r} belongs to a layer past the config's "
                                    f"{cfg.n_layers} layers")
        expert_of = re.compile(r"\.(?:experts|ffn_gate|ffn_up|ffn_down)\.(\d+)\.")
        past = [n for n in extra if cfg.moe and (m := expert_of.search(n)) and int(m.group(1)) >= cfg.n_experts]
        if past:
            raise InvalidCheckpoint(f"{where}: tensor {past[0]!r} is an expert past the config's {cfg.n_experts} "
                                    f"experts (they are numbered from 0)")
        raise UnsupportedArchitecture(f"{where}: tensor(s) {', '.join(extra[:6])}{', ...' if len(extra) > 6 else ''} "
                                      f"are not read by the {cfg.arch} description (its config does not say what "
                                      f"they do): refusing rather than ignoring them")
