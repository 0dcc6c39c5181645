"""Checkpoint → ``ModelConfig`` + the weights of one contiguous layer range, from GGUF or an HF directory.

Two sources, one contract (``Checkpoint``):

- a ``.gguf`` file, parsed once with the ``gguf`` package (llama.cpp's own reader) into a cached index
  (``ringshm.gguf_index``), its tensor bytes memory-mapped: metadata keys ``<arch>.*`` → ``ModelConfig``;
- a Hugging Face directory (``config.json`` + ``*.safetensors``), read lazily with ``safetensors.safe_open``.

Linear weights (and the embedding / LM head) stay in their encoding as ``RawWeight`` (``ringshm.qmatmul``):
GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / F16 / BF16 / F32 as views of the file's memory
map (no copy; stages of one engine share the page cache), safetensors F32 / F16 / BF16 as loaded. Other GGUF
types (Q2_K, Q3_K, IQ*, or a K-quant whose rows are not whole super-blocks) are dequantized to F32 at load
(``ringshm.dequant``). Norms and biases are small and come as fp32 tensors.

A stage reads only what it owns: its layers, plus the token embedding when it is first, and the final norm
and LM head when it is last. With tied embeddings the last stage's LM head *is* ``token_embd``; a stage that
is both first and last shares one tensor for both.

RoPE layout. The kernels rotate pairs ``(i, i + D/2)`` of each head (rotate-half, as HF Llama). llama.cpp's
converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the output rows of ``attn_q`` and
``attn_k`` for Llama-arch GGUFs so that ggml's adjacent-pair rotation ``(2i, 2i+1)`` gives the same result:
within each head the HF rows, indexed ``[half, i]`` (``half`` in {0, 1}, ``i < D/2``), are stored as
``[i, half]``. ``_unpermute_rows`` views each head's rows as ``[D/2, 2]`` and transposes back to
``[2, D/2]``. Qwen2 GGUFs are converted without the reorder (llama.cpp runs them with NeoX rotation).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from ringshm.config import ModelConfig
from ringshm.dequant import dequantize
from ringshm.errors import LayerRangeError, MissingTensor, UnsupportedArchitecture
from ringshm.gguf_index import GGUFIndex
from ringshm.qmatmul import RawWeight, native_ok

# Architectures computed by ringshm.model, and whether their GGUF Q/K rows carry llama.cpp's reorder.
GGUF_ARCHS = {"llama": True, "mistral": True, "qwen2": False}
HF_ARCHS = ("llama", "mistral", "qwen2")

# Per-layer tensors: field of LayerWeights → (GGUF name under blk.{i}., HF name under model.layers.{i}.)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm.weight", "input_layernorm.weight"),
    "wq": ("attn_q.weight", "self_attn.q_proj.weight"),
    "wk": ("attn_k.weight", "self_attn.k_proj.weight"),
    "wv": ("attn_v.weight", "self_attn.v_proj.weight"),
    "wo": ("attn_output.weight", "self_attn.o_proj.weight"),
    "ffn_norm": ("ffn_norm.weight", "post_attention_layernorm.weight"),
    "w_gate": ("ffn_gate.weight", "mlp.gate_proj.weight"),
    "w_up": ("ffn_up.weight", "mlp.up_proj.weight"),
    "w_down": ("ffn_down.weight", "mlp.down_proj.weight"),
}
_BIAS_TENSORS = {
    "bq": ("attn_q.bias", "self_attn.q_proj.bias"),
    "bk": ("attn_k.bias", "self_attn.k_proj.bias"),
    "bv": ("attn_v.bias", "self_attn.v_proj.bias"),
}
# Whole-model tensors: role → (GGUF name, HF name)
_GLOBAL_TENSORS = {
    "embed": ("token_embd.weight", "model.embed_tokens.weight"),
    "norm": ("output_norm.weight", "model.norm.weight"),
    "lm_head": ("output.weight", "lm_head.weight"),
}


@dataclass
class LayerWeights:
    """One decoder layer. Linear weights are ``RawWeight`` ``[out, in]`` (``F.linear`` layout) in the checkpoint's
    encoding; norms fp32 ``[hidden]``, biases fp32 ``[out]``.

    ``wq`` is ``[n_heads * head_dim, hidden]``, ``wk``/``wv`` ``[n_kv_heads * head_dim, hidden]`` with rows in
    rotate-half order, ``wo`` ``[hidden, n_heads * head_dim]``, ``w_gate``/``w_up`` ``[intermediate, hidden]``,
    ``w_down`` ``[hidden, intermediate]``; ``bq``/``bk``/``bv`` only for architectures with attention bias.
    """

    attn_norm: torch.Tensor
    wq: RawWeight
    wk: RawWeight
    wv: RawWeight
    wo: RawWeight
    ffn_norm: torch.Tensor
    w_gate: RawWeight
    w_up: RawWeight
    w_down: RawWeight
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None


@dataclass
class StageWeights:
    """The weights one stage owns: ``layers[j]`` is model layer ``layer_range[j]``.

    ``embed`` ``RawWeight [vocab, hidden]`` when first; ``norm`` fp32 ``[hidden]`` and ``lm_head``
    ``RawWeight [vocab, hidden]`` when last (``lm_head is embed`` when the model ties them and the stage is both).
    """

    layer_range: range
    layers: list[LayerWeights] = field(default_factory=list)
    embed: RawWeight | None = None
    norm: torch.Tensor | None = None
    lm_head: RawWeight | None = None

    def select(self, layer_range: range | tuple[int, int], is_first: bool, is_last: bool) -> StageWeights:
        """The weights of a sub-stage, sharing tensors (no copy): for building several stages from one load.

        Raises:
            LayerRangeError: ``layer_range`` not inside this one's. ValueError: a part it needs was not loaded.
        """
        r = layer_range if isinstance(layer_range, range) else range(*layer_range)
        mine = self.layer_range
        if r.step != 1 or len(r) == 0 or r.start < mine.start or r.stop > mine.stop:
            raise LayerRangeError(f"layer range [{r.start}, {r.stop}) is not inside the loaded "
                                  f"[{mine.start}, {mine.stop})")
        if (is_first and self.embed is None) or (is_last and (self.norm is None or self.lm_head is None)):
            raise ValueError("select: the embedding or the final norm / LM head was not loaded")
        return StageWeights(layer_range=r, layers=self.layers[r.start - mine.start:r.stop - mine.start],
                            embed=self.embed if is_first else None, norm=self.norm if is_last else None,
                            lm_head=self.lm_head if is_last else None)


def check_layer_range(layer_range: range | tuple[int, int], n_layers: int) -> range:
    """Normalize ``(start, stop)`` or a step-1 ``range`` to ``range(start, stop)`` inside ``[0, n_layers)``.

    Raises:
        LayerRangeError: empty, stepped, or outside the model's ``n_layers``.
    """
    r = layer_range if isinstance(layer_range, range) else range(*layer_range)
    if r.step != 1 or len(r) == 0 or r.start < 0 or r.stop > n_layers:
        raise LayerRangeError(f"layer range [{r.start}, {r.stop}) (step {r.step}) is not a non-empty "
                              f"contiguous range inside the model's {n_layers} layers [0, {n_layers})")
    return r


class _Source(Protocol):
    path: Path

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_raw(self, name: str) -> RawWeight: ...


class _GGUFSource:
    """Tensors of a GGUF file, dequantized to fp32 on demand. The metadata and tensor table come from the
    cached ``GGUFIndex`` (parsing a GGUF takes seconds); tensor bytes are memory-mapped and read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.index = GGUFIndex.open(path)

    def meta(self, key: str, default=None):
        return self.index.meta.get(key, default)

    def has(self, name: str) -> bool:
        return name in self.index.tensors

    def get(self, name: str) -> torch.Tensor:
        t = self.index.tensors[name]
        shape = tuple(reversed(t.shape))  # GGUF lists dims innermost first
        return dequantize(self.index.raw(name), t.qtype, shape, name=name)

    def get_raw(self, name: str) -> RawWeight:
        """A 2-D tensor in its encoding when the matmul reads it (a view of the memory map), else as F32."""
        t = self.index.tensors[name]
        if len(t.shape) != 2:
            raise MissingTensor(f"tensor {name!r} in {self.path} is {len(t.shape)}-D, expected a 2-D weight")
        k, n = t.shape  # GGUF order: innermost (K) first
        if native_ok(t.qtype, n, k):
            with warnings.catch_warnings():  # a read-only map: the kernels only read it
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")
                data = torch.from_numpy(self.index.raw(name))
            return RawWeight.from_bytes(t.qtype, n, k, data)
        return RawWeight.from_tensor(self.get(name))


class _HFSource:
    """Tensors of an HF directory's ``*.safetensors`` files, opened lazily by name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file_of: dict[str, Path] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise MissingTensor(f"no *.safetensors files in {path}")
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    self.file_of[k] = f

    def has(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.file_of[name]), framework="pt") as st:
            return st.get_tensor(name)

    def get_raw(self, name: str) -> RawWeight:
        """F32 / F16 / BF16 weights as stored (no fp32 copy of a bf16 checkpoint); other dtypes as F32."""
        w = self.get(name)
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            w = w.float()
        return RawWeight.from_tensor(w)


class Checkpoint:
    """An opened checkpoint: its ``config`` and a way to load any stage's weights from it.

    ``Checkpoint.open(path)`` takes a ``.gguf`` file or an HF directory holding ``config.json``.

    Raises:
        FileNotFoundError: ``path`` is neither.
        UnsupportedArchitecture: the architecture (or its RoPE scaling) is not one ringshm computes.
    """

    def __init__(self, path: Path, source: _Source, config: ModelConfig, gguf: bool) -> None:
        self.path, self.source, self.config, self.gguf = path, source, config, gguf

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            src = _GGUFSource(path)
            return cls(path, src, _gguf_config(src), gguf=True)
        if path.is_dir() and (path / "config.json").is_file():
            src = _HFSource(path)
            return cls(path, src, _hf_config(path, src), gguf=False)
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a directory with config.json")

    def load_stage(self, layer_range: range | tuple[int, int], is_first: bool, is_last: bool) -> StageWeights:
        """Read only the tensors of this stage: linear weights in their encoding, norms and biases as fp32.

        Raises:
            LayerRangeError: ``layer_range`` empty or outside ``[0, n_layers)``.
            MissingTensor: a tensor the stage needs is not in the checkpoint (named in the message).
            UnsupportedQuantType: a needed GGUF tensor's type cannot be dequantized.
        """
        cfg = self.config
        r = check_layer_range(layer_range, cfg.n_layers)
        side = 0 if self.gguf else 1

        def need(name: str, what: str) -> None:
            if not self.source.has(name):
                raise MissingTensor(f"tensor {name!r} ({what}) not found in {self.path}")

        def get(name: str, what: str) -> torch.Tensor:
            need(name, what)
            return self.source.get(name).to(torch.float32).contiguous()

        def get_raw(name: str, what: str) -> RawWeight:
            need(name, what)
            return self.source.get_raw(name)

        out = StageWeights(layer_range=r)
        for i in r:
            prefix = f"blk.{i}." if self.gguf else f"model.layers.{i}."
            w = {f: (get_raw if f.startswith("w") else get)(prefix + names[side], f"layer {i} {f}")
                 for f, names in _LAYER_TENSORS.items()}
            if cfg.attention_bias:
                w.update({f: get(prefix + names[side], f"layer {i} {f}") for f, names in _BIAS_TENSORS.items()})
            if self.gguf and GGUF_ARCHS[cfg.arch]:
                for f, n_heads in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads), ("bq", cfg.n_heads),
                                   ("bk", cfg.n_kv_heads)):
                    if f in w:
                        order = _unpermute_rows(torch.arange(w[f].shape[0]), n_heads)
                        w[f] = w[f].rows(order) if isinstance(w[f], RawWeight) else w[f][order].contiguous()
            out.layers.append(LayerWeights(**w))
        names = {role: pair[side] for role, pair in _GLOBAL_TENSORS.items()}
        if is_first or (is_last and cfg.tie_embeddings):
            out.embed = get_raw(names["embed"], "token embedding")
        if is_last:
            out.norm = get(names["norm"], "final norm")
            out.lm_head = out.embed if cfg.tie_embeddings else get_raw(names["lm_head"], "LM head")
            if not is_first:
                out.embed = None  # held only as the tied head
        return out


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row reorder: per head, rows ``[D/2, 2]`` → ``[2, D/2]`` (see module docstring).

    Shapes: ``w`` ``[n_heads * D, ...]`` → same shape, rows of each head in rotate-half order. Applied to
    ``arange(n_heads * D)`` it gives the row order, which reorders encoded rows too.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    # [n_heads*D, *rest] -> [n_heads, D/2, 2, *rest] -> [n_heads, 2, D/2, *rest] -> [n_heads*D, *rest]
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def read_config(path: str | Path) -> ModelConfig:
    """Return the ``ModelConfig`` of a ``.gguf`` file or an HF directory (see ``Checkpoint.open``)."""
    return Checkpoint.open(path).config


def load_stage_weights(path: str | Path, layer_range: range | tuple[int, int], is_first: bool,
                       is_last: bool) -> tuple[ModelConfig, StageWeights]:
    """Open ``path`` and load one stage's weights (see ``Checkpoint.load_stage``)."""
    ckpt = Checkpoint.open(path)
    return ckpt.config, ckpt.load_stage(layer_range, is_first, is_last)


def _gguf_config(src: _GGUFSource) -> ModelConfig:
    arch = src.meta("general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedArchitecture(f"GGUF architecture {arch!r} in {src.path} is not supported "
                                      f"(supported: {', '.join(GGUF_ARCHS)})")
    scaling = src.meta(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or src.has("rope_freqs.weight"):
        raise UnsupportedArchitecture(f"RoPE scaling ({scaling or 'rope_freqs.weight'}) in {src.path} "
                                      f"is not supported")

    def need(key: str):
        value = src.meta(f"{arch}.{key}")
        if value is None:
            raise UnsupportedArchitecture(f"GGUF metadata key {arch}.{key!r} missing in {src.path}")
        return value

    n_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = src.meta(f"{arch}.vocab_size")
    if vocab is None:
        vocab = src.index.array_lengths.get("tokenizer.ggml.tokens")
        if vocab is None:
            vocab = int(src.index.tensors["token_embd.weight"].shape[1])
    eos = src.meta("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        arch=arch,
        n_layers=int(need("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(src.meta(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(src.meta(f"{arch}.attention.key_length", hidden // n_heads)),
        intermediate=int(need("feed_forward_length")),
        vocab=int(vocab),
        rope_theta=float(src.meta(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_embeddings=not src.has("output.weight"),
        max_seq_len=int(need("context_length")),
        bos_token_id=_opt_int(src.meta("tokenizer.ggml.bos_token_id")),
        eos_token_ids=() if eos is None else (int(eos),),
        attention_bias=src.has("blk.0.attn_q.bias"),
    )


def _hf_config(path: Path, src: _HFSource) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    arch = c.get("model_type")
    if arch not in HF_ARCHS:
        raise UnsupportedArchitecture(f"model_type {arch!r} in {path / 'config.json'} is not supported "
                                      f"(supported: {', '.join(HF_ARCHS)})")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UnsupportedArchitecture(f"RoPE scaling {rope!r} in {path / 'config.json'} is not supported")
    n_heads = c["num_attention_heads"]
    eos = c.get("eos_token_id")
    return ModelConfig(
        arch=arch,
        n_layers=c["num_hidden_layers"],
        hidden=c["hidden_size"],
        n_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads") or n_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        intermediate=c["intermediate_size"],
        vocab=c["vocab_size"],
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        max_seq_len=c.get("max_position_embeddings", 2048),
        bos_token_id=_opt_int(c.get("bos_token_id")),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        attention_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
    )


def _opt_int(value) -> int | None:
    return None if value is None else int(value)
