"""Checkpoint → ``ModelConfig`` + the weights of one contiguous layer range, from GGUF or an HF directory.

``Checkpoint.open(path)`` takes a ``.gguf`` file or an HF directory (``config.json`` + ``*.safetensors``); its
``source`` (``ringshm.model.sources``) reads tensors, its ``config`` is what the family description
(``ringshm.model.families``) makes of the metadata. Linear weights (and the embedding / LM head) stay in their
encoding as ``RawWeight`` (``ringshm.model.qmatmul``) where the matmul reads it; other GGUF types are dequantized
to fp32 at load, and the stage says so in one line (``stage_bytes`` counts them at that size). Norms and biases
are small and come as fp32 tensors; every RMSNorm weight as ``norm_offset + w``.

A stage reads only what it owns: its layers, plus the token embedding when it is first, and the final norm
and LM head when it is last. With tied embeddings the last stage's LM head *is* ``token_embd``; a stage that
is both first and last shares one tensor for both. A tensor of a layer that the description does not read is
refused, never ignored.

RoPE layout. The kernels rotate pairs ``(i, i + D/2)`` of each head (rotate-half, as HF Llama). llama.cpp's
converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the output rows of ``attn_q`` and
``attn_k`` for Llama-arch GGUFs so that ggml's adjacent-pair rotation ``(2i, 2i+1)`` gives the same result:
within each head the HF rows, indexed ``[half, i]`` (``half`` in {0, 1}, ``i < D/2``), are stored as
``[i, half]``. ``_unpermute_rows`` views each head's rows as ``[D/2, 2]`` and transposes back to
``[2, D/2]``. Other arches' GGUFs are converted without the reorder (llama.cpp runs them with NeoX rotation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ringshm.errors import LayerRangeError
from ringshm.model import families
from ringshm.model.checkpoint_check import check_checkpoint
from ringshm.model.expert_readers import ExpertReader
from ringshm.model.qmatmul import RawWeight, count_nonfinite
from ringshm.model.sources import GGUFSource, HFSource, Source
from ringshm.model_config import ModelConfig

log = logging.getLogger("ringshm.model.loader")


@dataclass
class LayerWeights:
    """One decoder layer. Linear weights are ``RawWeight`` ``[out, in]`` (``F.linear`` layout) in the checkpoint's
    encoding; norms fp32 ``[hidden]``, biases fp32 ``[out]``.

    ``wq`` is ``[n_heads * head_dim, hidden]``, ``wk``/``wv`` ``[n_kv_heads * head_dim, hidden]`` with rows in
    rotate-half order, ``wo`` ``[hidden, n_heads * head_dim]``, ``w_gate``/``w_up`` ``[intermediate, hidden]``,
    ``w_down`` ``[hidden, intermediate]``; ``bq``/``bk``/``bv`` only for architectures with attention bias,
    ``bo`` with an output bias, ``b_gate``/``b_up``/``b_down`` with MLP biases; ``q_norm``/``k_norm`` fp32
    ``[head_dim]`` with per-head q/k norms; ``post_attn_norm``/``post_ffn_norm`` fp32 ``[hidden]`` with post
    norms (``ModelConfig``), ``[q_dim]`` / ``[kv_dim]`` when they cover the whole projection. Every RMSNorm weight
    already holds ``norm_offset + w``.

    A routed MoE layer (``ModelConfig.moe``) has no ``w_gate`` / ``w_up`` / ``w_down`` (None) but ``w_router``
    ``[n_experts, hidden]`` and, per expert ``e`` (lists of ``n_experts``), ``w_exp_gate[e]`` / ``w_exp_up[e]``
    ``[expert_intermediate, hidden]`` and ``w_exp_down[e]`` ``[hidden, expert_intermediate]``; with a shared
    expert (``ModelConfig.shared_expert_intermediate`` = S > 0) also ``w_shexp_gate`` / ``w_shexp_up`` ``[S, hidden]``,
    ``w_shexp_down`` ``[hidden, S]`` and, with its gate, ``shexp_gate_inp`` fp32 ``[hidden]``. gpt-oss adds
    ``sinks`` fp32 ``[n_heads]`` (``ModelConfig.attention_sinks``) and (``moe_bias``) the router's bias ``b_router``
    ``[n_experts]`` and the experts' ``b_exp_gate`` / ``b_exp_up`` ``[n_experts, expert_intermediate]``,
    ``b_exp_down`` ``[n_experts, hidden]``, fp32.
    """

    attn_norm: torch.Tensor
    wq: RawWeight
    wk: RawWeight
    wv: RawWeight
    wo: RawWeight
    ffn_norm: torch.Tensor
    w_gate: RawWeight | None = None
    w_up: RawWeight | None = None
    w_down: RawWeight | None = None
    bq: torch.Tensor | None = None
    bk: torch.Tensor | None = None
    bv: torch.Tensor | None = None
    bo: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    w_router: RawWeight | None = None
    w_exp_gate: list[RawWeight] | None = None
    w_exp_up: list[RawWeight] | None = None
    w_exp_down: list[RawWeight] | None = None
    w_shexp_gate: RawWeight | None = None
    w_shexp_up: RawWeight | None = None
    w_shexp_down: RawWeight | None = None
    shexp_gate_inp: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    b_router: torch.Tensor | None = None
    b_exp_gate: torch.Tensor | None = None
    b_exp_up: torch.Tensor | None = None
    b_exp_down: torch.Tensor | None = None


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


class Checkpoint:
    """An opened and checked checkpoint: its ``config`` and a way to load any stage's weights from it.

    ``Checkpoint.open(path)`` takes a ``.gguf`` file or an HF directory holding ``config.json`` and runs the
    checkpoint check (``ringshm.model.checkpoint_check``) first: every tensor a stage reads is then present, of a
    type the loader reads and of the shape the config implies, and nothing else is in the file.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is neither.
        InvalidCheckpoint (MissingTensor among them): the file breaks a rule (named in the message).
        UnsupportedArchitecture: the architecture (or a setting or tensor) is not one ringshm computes.
    """

    def __init__(self, path: Path, source: Source, config: ModelConfig, gguf: bool) -> None:
        self.path, self.source, self.config, self.gguf = path, source, config, gguf
        self._experts = ExpertReader(source, config, gguf)

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        checked = check_checkpoint(path)
        src = GGUFSource(checked.path, checked.index) if checked.gguf else HFSource(checked.path, checked.index)
        return cls(checked.path, src, checked.config, checked.gguf)

    def stage_bytes(self, layer_range: range | tuple[int, int], is_first: bool, is_last: bool, native: bool = True,
                    width: float = 4.0) -> tuple[int, list[str]]:
        """The bytes one stage holds for its weights, and the 2-D tensors it expands at load (names).

        ``native``: the stage runs the C matmul (CPU, fp32 activations), which reads a weight in its encoding
        when it can (``native_ok``): such a tensor counts its stored bytes (packed panels; the embedding is read
        through the file's map). Every other weight counts ``width`` bytes per parameter: 4 for a type the
        matmul does not read (dequantized to fp32 at load), the dtype's width on a torch path; a layer's gate and
        up (or its shared expert's) of two different types count 4 each, as one matmul holds them in F32. Counts what
        ``load_stage`` reads: the stage's layers, the embedding when first (or tied and last), the final norm
        and the LM head when last.

        Raises:
            LayerRangeError: as ``load_stage``.
        """
        cfg = self.config
        r = check_layer_range(layer_range, cfg.n_layers)
        side = 0 if self.gguf else 1
        names = [n for i in r for n in self.source.names_under(f"blk.{i}." if self.gguf else f"model.layers.{i}.")]
        roles = {role: pair[side] for role, pair in families.GLOBAL_TENSORS.items()}
        if is_first or (is_last and cfg.tie_embeddings):
            names.append(roles["embed"])
        if is_last:
            names += [roles["norm"]] + ([] if cfg.tie_embeddings else [roles["lm_head"]])
        # gate and up run as one matmul (layer.py's concat_rows): of two types, both are held in F32
        layer_names = families.TENSOR_NAMES[cfg.arch].layer
        widened = set()
        for i in r if native else ():
            prefix = f"blk.{i}." if self.gguf else f"model.layers.{i}."
            for gate, up in (("w_gate", "w_up"), ("w_shexp_gate", "w_shexp_up")):
                pair = [prefix + layer_names[f][side] for f in (gate, up) if f in layer_names]
                if (len(pair) == 2 and pair[0] != pair[1] and all(self.source.has(n) for n in pair)
                        and self.source.type_name(pair[0]) != self.source.type_name(pair[1])):
                    widened.update(pair)
        total, expanded = 0, []
        for name in names:
            if self.source.has(name):
                n, grown = self.source.held_bytes(name, native and name not in widened, 4.0 if name in widened
                                                  else width)
                total += n
                if grown or name in widened:
                    expanded.append(name)
        return total, expanded

    def load_stage(self, layer_range: range | tuple[int, int], is_first: bool, is_last: bool) -> StageWeights:
        """Read only the tensors of this stage: linear weights in their encoding, norms and biases as fp32.

        What is read was checked when the checkpoint was opened (present, readable type, shape).

        Raises:
            LayerRangeError: ``layer_range`` empty or outside ``[0, n_layers)``.
        """
        cfg = self.config
        r = check_layer_range(layer_range, cfg.n_layers)
        side = 0 if self.gguf else 1
        self._say_expanded(r, is_first, is_last)

        loaded: list[tuple[str, RawWeight | torch.Tensor]] = []  # what the stage read, for _say_nonfinite

        def get(name: str) -> torch.Tensor:
            loaded.append((name, self.source.get(name).to(torch.float32).contiguous()))
            return loaded[-1][1]

        def get_raw(name: str) -> RawWeight:
            loaded.append((name, self.source.get_raw(name)))
            return loaded[-1][1]

        out = StageWeights(layer_range=r)
        names = families.TENSOR_NAMES[cfg.arch]
        permute = self.gguf and cfg.arch in families.GGUF_PERMUTED_QK
        for i in r:
            prefix = f"blk.{i}." if self.gguf else f"model.layers.{i}."
            w = {}
            for f, pair in names.layer.items():
                if not families.wanted(cfg, f, names) or (f == "w_shexp_up" and names.hf_fused_shexp and not self.gguf):
                    continue  # (Granite's HF shared expert: up is read with gate, one tensor)
                name = prefix + pair[side]
                if f in families.EXPERT_FIELDS:
                    w[f] = self._experts.read(prefix, f, pair[side], loaded)
                elif f in ("b_exp_gate", "b_exp_up") and names.hf_transposed_experts and not self.gguf:
                    w[f] = get(name)[:, 0 if f == "b_exp_gate" else 1::2].contiguous()  # [E, 2 I] interleaved
                elif f in ("b_exp_gate", "b_exp_up") and self.source.has(merged_bias := prefix + families.
                                                                          GGUF_MERGED_GATE_UP_EXPS_BIAS):
                    both, ie = get(merged_bias), cfg.expert_intermediate  # [E, 2 I] rows [gate | up]
                    w[f] = both[:, :ie].contiguous() if f == "b_exp_gate" else both[:, ie:].contiguous()
                elif f == "shexp_gate_inp":  # [hidden]; HF holds it as a linear layer's [1, hidden] weight
                    w[f] = get(name).reshape(-1)
                else:
                    w[f] = get_raw(name) if f.startswith("w") else self._norm(get(name), f)
            if names.fused_qkv:  # rows [q | k | v] of one tensor
                qkv = w.pop("wq")
                w["wq"], w["wk"], w["wv"] = (qkv.rows(torch.arange(a, b)) for a, b in _splits(
                    (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)))
            if names.hf_fused_shexp and not self.gguf and "w_shexp_gate" in w:  # rows [gate | up] of one tensor
                fused, si = w.pop("w_shexp_gate"), cfg.shared_expert_intermediate
                w["w_shexp_gate"], w["w_shexp_up"] = (fused.rows(torch.arange(a, b)) for a, b in _splits((si, si)))
            if names.fused_gate_up:  # rows [gate | up] of one tensor
                gate_up = w.pop("w_gate")
                w["w_gate"], w["w_up"] = (gate_up.rows(torch.arange(a, b)) for a, b in _splits(
                    (cfg.intermediate, cfg.intermediate)))
            if permute:
                for f, n_heads in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads), ("bq", cfg.n_heads),
                                   ("bk", cfg.n_kv_heads)):
                    if f in w:
                        order = _unpermute_rows(torch.arange(w[f].shape[0]), n_heads)
                        w[f] = w[f].rows(order) if isinstance(w[f], RawWeight) else w[f][order].contiguous()
            out.layers.append(LayerWeights(**w))
        roles = {role: pair[side] for role, pair in families.GLOBAL_TENSORS.items()}
        if is_first or (is_last and cfg.tie_embeddings):
            out.embed = get_raw(roles["embed"])
        if is_last:
            out.norm = self._norm(get(roles["norm"]), "norm")
            out.lm_head = out.embed if cfg.tie_embeddings else get_raw(roles["lm_head"])
            if not is_first:
                out.embed = None  # held only as the tied head
        _say_nonfinite(r, loaded)
        return out

    def _say_expanded(self, r: range, is_first: bool, is_last: bool) -> None:
        """One line on stderr naming the weights of this stage that the matmul does not read in their encoding
        (GGUF Q2_K / Q3_K / IQ*, or a gate and up of two types), which are dequantized to fp32 at load, and the
        memory that costs."""
        held, expanded = self.stage_bytes(r, is_first, is_last)
        if not expanded:
            return
        grown = sum(self.source.held_bytes(n, False, 4.0)[0] for n in expanded)
        types = sorted({self.source.type_name(n) for n in expanded})
        log.warning("layers %d-%d: %d weight tensors of type %s are not read in their encoding by the matmul (a type "
                    "it does not read, or a gate and up of two types, which one matmul cannot hold) and are "
                    "dequantized to fp32 at load (%.0f MiB, %.1fx their file size): %s", r.start, r.stop - 1,
                    len(expanded), "/".join(types), grown / 2**20,
                    grown / max(1, sum(self.source.stored_bytes(n) for n in expanded)),
                    ", ".join(expanded[:6]) + (", ..." if len(expanded) > 6 else ""))

    def _norm(self, w: torch.Tensor, field: str) -> torch.Tensor:
        """An RMSNorm weight as the kernels take it: ``norm_offset + w`` in fp32 (Gemma's HF checkpoints store
        ``w - 1``; its GGUF files the sum already, llama.cpp's converter adds it), other tensors unchanged."""
        if field.endswith("norm") and self.config.norm_offset and not self.gguf:
            return (w + self.config.norm_offset).contiguous()
        return w

def _say_nonfinite(r: range, loaded: list[tuple[str, RawWeight | torch.Tensor]]) -> None:
    """One line on stderr naming the tensors of this stage that hold NaN or Inf (values, or quantized blocks with
    a non-finite scale: ``qmatmul.count_nonfinite``), so a broken file is said at load, not served as garbage."""
    bad = [(name, *count_nonfinite(w)) for name, w in loaded]
    bad = [(name, n, unit) for name, n, unit in bad if n]
    if bad:
        log.warning("layers %d-%d: %d tensor(s) hold NaN / Inf, which the model's outputs will carry: %s", r.start,
                    r.stop - 1, len(bad), ", ".join(f"{name} ({n} {unit})" for name, n, unit in bad[:6])
                    + (", ..." if len(bad) > 6 else ""))


def _splits(widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """Consecutive ``(start, stop)`` row ranges of the given widths."""
    out, at = [], 0
    for w in widths:
        out.append((at, at + w))
        at += w
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
    """Return the ``ModelConfig`` of a ``.gguf`` file or an HF directory, checked (``check_checkpoint``)."""
    return check_checkpoint(path).config


def load_stage_weights(path: str | Path, layer_range: range | tuple[int, int], is_first: bool,
                       is_last: bool) -> tuple[ModelConfig, StageWeights]:
    """Open ``path`` and load one stage's weights (see ``Checkpoint.load_stage``)."""
    ckpt = Checkpoint.open(path)
    return ckpt.config, ckpt.load_stage(layer_range, is_first, is_last)
