"""How the zoo (``tests/zoo.py``) lays out routed experts, HF side and GGUF side, per family: transformers' fused
tensors as the converter splits and stacks them (``add_experts``), Granite's ``input_linear`` / ``output_linear``
(``add_granite_moe``) and shared expert (``add_granite_shared_gate_up``), gpt-oss's transposed, interleaved experts
in MXFP4 (``add_gptoss_experts``), and gpt-oss as OpenAI releases it, its experts as MXFP4 blocks
(``gptoss_mxfp4_hf``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from zoo_quant import make_weight, tensor_type

if TYPE_CHECKING:
    from zoo import Family, ZooModel


def add_experts(hf_name: str, shape: tuple[int, ...], spec: Family, recipe: str, n_layers: int, tied: bool,
                 rng: np.random.Generator, gguf_tensors: list, hf_tensors: dict) -> None:
    """One layer's routed experts, as the converter writes them from a checkpoint on disk: transformers' fused
    ``mlp.experts.gate_up_proj`` ``[E, 2 I, hidden]`` becomes GGUF ``ffn_gate_exps`` and ``ffn_up_exps``
    ``[E, I, hidden]`` and HF ``mlp.experts.{e}.gate_proj`` / ``up_proj`` ``[I, hidden]`` (what ``save_pretrained``
    writes and released checkpoints hold); ``mlp.experts.down_proj`` becomes ``ffn_down_exps`` and ``down_proj``."""
    prefix, part = hf_name.split(".mlp.experts.")
    layer = int(prefix.split(".")[-1])
    n_exp = shape[0]
    if part == "gate_up_proj":
        roles = (("ffn_gate_exps", "gate_proj", shape[1] // 2), ("ffn_up_exps", "up_proj", shape[1] // 2))
    else:
        roles = (("ffn_down_exps", "down_proj", shape[1]),)
    for role, hf_part, rows in roles:
        qtype = tensor_type(recipe, role, layer, n_layers, shape[2], 3, tied)
        raw, vals = make_weight(qtype, (n_exp * rows, shape[2]), spec.std["linear"], rng)
        gguf_tensors.append((f"blk.{layer}.{role}.weight", raw.reshape(n_exp, rows, -1), qtype))
        for e in range(n_exp):
            hf_tensors[f"{prefix}.mlp.experts.{e}.{hf_part}.weight"] = torch.from_numpy(
                np.ascontiguousarray(vals[e * rows:(e + 1) * rows], dtype=np.float32))


def add_gptoss_experts(hf_name: str, shape: tuple[int, ...], spec: Family, rng: np.random.Generator,
                        gguf_tensors: list, hf_tensors: dict) -> None:
    """One gpt-oss layer's experts or their biases, as llama.cpp's ``GptOssModel`` converts them: HF
    ``gate_up_proj`` ``[E, hidden, 2 I]`` (``x . W``, columns gate 0, up 0, gate 1, ...) becomes ``ffn_gate_exps`` and
    ``ffn_up_exps`` ``[E, I, hidden]``, ``down_proj`` ``[E, I, hidden]`` becomes ``ffn_down_exps`` ``[E, hidden, I]``
    (MXFP4: the released checkpoints' experts are MXFP4 and the converter repacks their blocks as they are);
    ``gate_up_proj_bias`` ``[E, 2 I]`` splits the same way into ``ffn_{gate,up}_exps.bias`` ``[E, I]`` (F32)."""
    prefix, part = hf_name.split(".mlp.experts.")
    layer = int(prefix.split(".")[-1])
    n_exp = shape[0]
    # MXFP4 blocks hold 32 weights of a row; rows of another width are written as floats (the converter's F32)
    mx = gguf.GGMLQuantizationType.MXFP4 if shape[1] % 32 == 0 else gguf.GGMLQuantizationType.F32
    if part in ("gate_up_proj", "gate_up_proj_bias"):
        width = shape[-1] // 2
        full = np.zeros(shape, np.float32)
        for role, first in (("ffn_gate_exps", 0), ("ffn_up_exps", 1)):
            if part == "gate_up_proj":  # [E, I, hidden] in GGUF; HF columns first, first + 2, ...
                raw, vals = make_weight(mx, (n_exp * width, shape[1]), spec.std["linear"], rng)
                gguf_tensors.append((f"blk.{layer}.{role}.weight", raw.reshape(n_exp, width, -1), mx))
                full[:, :, first::2] = vals.reshape(n_exp, width, shape[1]).transpose(0, 2, 1)
            else:
                vals = rng.normal(0.0, spec.std["bias"], size=(n_exp, width)).astype(np.float32)
                gguf_tensors.append((f"blk.{layer}.{role}.bias", vals, gguf.GGMLQuantizationType.F32))
                full[:, first::2] = vals
        hf_tensors[hf_name] = torch.from_numpy(full)
        return
    if part == "down_proj":  # HF [E, I, hidden] (x . W); GGUF [E, hidden, I]
        raw, vals = make_weight(mx, (n_exp * shape[2], shape[1]), spec.std["linear"], rng)
        gguf_tensors.append((f"blk.{layer}.ffn_down_exps.weight", raw.reshape(n_exp, shape[2], -1), mx))
        hf_tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(
            vals.reshape(n_exp, shape[2], shape[1]).transpose(0, 2, 1)))
        return
    vals = rng.normal(0.0, spec.std["bias"], size=shape).astype(np.float32)  # down_proj_bias [E, hidden]
    gguf_tensors.append((f"blk.{layer}.ffn_down_exps.bias", vals, gguf.GGMLQuantizationType.F32))
    hf_tensors[hf_name] = torch.from_numpy(vals)


def gptoss_mxfp4_hf(model: ZooModel, dest: Path) -> Path:
    """``model`` (the ``gptoss`` family) as OpenAI releases gpt-oss on the Hugging Face Hub: the experts as MXFP4
    ``gate_up_proj_blocks`` / ``_scales`` and ``down_proj_blocks`` / ``_scales`` (uint8 ``[E, rows, K / 32, 16]`` and
    ``[E, rows, K / 32]``, rows not transposed, gate_up's rows interleaved gate / up; block byte j holds weights 2j
    and 2j + 1; scale s means 2^(s - 127) on e2m1 values), ``quantization_config`` ``quant_method: mxfp4``, every
    other tensor as in ``model.hf_dir``. Made from the GGUF's MXFP4 bytes (ggml's layout: byte j holds weights j and
    j + 16, half-scale 2^(e - 128) on doubled values, so e = s): the same numbers, re-laid. Returns ``dest``."""
    import json
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(model.hf_dir, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    reader = gguf.GGUFReader(str(model.gguf_path))
    raw = {t.name: np.array(t.data) for t in reader.tensors if "_exps.weight" in t.name}

    def openai(ggml: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:  # [E, rows, G * 17] -> blocks, scales
        e, rows, width = ggml.shape
        b = ggml.reshape(e, rows, width // 17, 17)
        nib = np.concatenate([b[..., 1:] & 0x0F, b[..., 1:] >> 4], axis=-1)  # [.., 32] weights in order
        blocks = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)
        return torch.from_numpy(np.ascontiguousarray(blocks)), torch.from_numpy(np.ascontiguousarray(b[..., 0]))

    for i in range(model.config.num_hidden_layers):
        gate, up = (raw[f"blk.{i}.ffn_{r}_exps.weight"] for r in ("gate", "up"))
        both = np.stack([gate, up], axis=2).reshape(gate.shape[0], 2 * gate.shape[1], gate.shape[2])  # interleaved
        prefix = f"model.layers.{i}.mlp.experts."
        for part, ggml in (("gate_up_proj", both), ("down_proj", raw[f"blk.{i}.ffn_down_exps.weight"])):
            del tensors[prefix + part]
            tensors[prefix + part + "_blocks"], tensors[prefix + part + "_scales"] = openai(ggml)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    return dest


def add_granite_moe(hf_name: str, shape: tuple[int, ...], spec: Family, recipe: str, n_layers: int, tied: bool,
                     rng: np.random.Generator, gguf_tensors: list, hf_tensors: dict) -> None:
    """One Granite MoE layer's router or experts, under the names ``save_pretrained`` writes and released Granite
    checkpoints hold (``block_sparse_moe.router.layer``, ``input_linear`` ``[E, 2 I, hidden]`` rows [gate | up],
    ``output_linear`` ``[E, hidden, I]``), and as llama.cpp's ``GraniteMoeModel`` converts them (``ffn_gate_inp``;
    ``input_linear`` split into ``ffn_gate_exps`` and ``ffn_up_exps``; ``ffn_down_exps``)."""
    prefix, part = hf_name.split(".block_sparse_moe.")
    layer = int(prefix.split(".")[-1])
    base = f"{prefix}.block_sparse_moe"
    if part == "router.weight":
        vals = rng.normal(0.0, spec.std["linear"], size=shape).astype(np.float32)
        gguf_tensors.append((f"blk.{layer}.ffn_gate_inp.weight", vals, tensor_type(recipe, "ffn_gate_inp", layer,
                                                                                   n_layers, shape[1], 2, tied)))
        hf_tensors[f"{base}.router.layer.weight"] = torch.from_numpy(vals)
        return
    n_exp = shape[0]
    roles = ((("ffn_gate_exps", shape[1] // 2), ("ffn_up_exps", shape[1] // 2)) if part == "experts.gate_up_proj"
             else (("ffn_down_exps", shape[1]),))
    parts = []
    for role, rows in roles:
        qtype = tensor_type(recipe, role, layer, n_layers, shape[2], 3, tied)
        raw, vals = make_weight(qtype, (n_exp * rows, shape[2]), spec.std["linear"], rng)
        gguf_tensors.append((f"blk.{layer}.{role}.weight", raw.reshape(n_exp, rows, -1), qtype))
        parts.append(vals.reshape(n_exp, rows, shape[2]))
    name = "input_linear" if part == "experts.gate_up_proj" else "output_linear"
    hf_tensors[f"{base}.{name}.weight"] = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=1)))


def add_granite_shared_gate_up(hf_name: str, shape: tuple[int, ...], spec: Family, recipe: str, n_layers: int,
                                tied: bool, rng: np.random.Generator, gguf_tensors: list, hf_tensors: dict) -> None:
    """Granite MoE Shared's ``shared_mlp.input_linear`` ``[2 S, hidden]`` (rows [gate | up]) as llama.cpp's
    ``GraniteMoeModel`` splits it: ``ffn_gate_shexp`` and ``ffn_up_shexp`` ``[S, hidden]``."""
    layer = int(hf_name.split(".")[2])
    parts = []
    for role in ("ffn_gate_shexp", "ffn_up_shexp"):
        qtype = tensor_type(recipe, role, layer, n_layers, shape[1], 2, tied)
        raw, vals = make_weight(qtype, (shape[0] // 2, shape[1]), spec.std["linear"], rng)
        gguf_tensors.append((f"blk.{layer}.{role}.weight", raw, qtype))
        parts.append(vals)
    hf_tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=0)))
