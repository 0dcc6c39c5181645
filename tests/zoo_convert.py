"""What llama.cpp's ``convert_hf_to_gguf.py`` writes for each zoo family: tensor names, metadata keys and the
transforms it applies to HF tensors (read at ggml-org/llama.cpp: ``convert_hf_to_gguf.py``'s ``TextModel``,
``LlamaModel``, ``Qwen2Model``, ``Qwen3Model``, ``Gemma3Model``, ``Phi3MiniModel``; gguf-py's
``tensor_mapping.py`` and ``constants.py``; ``src/models/gemma3.cpp`` and the Gemma 3 hparams in
``src/llama-model.cpp``), for ``tests/zoo.py``.

- every family: ``general.architecture``, ``general.type`` (``model``), ``general.name``, ``general.size_label``,
  ``general.file_type``, ``general.quantization_version``; all but phi3 then get ``TextModel``'s keys under
  ``<arch>.``: ``block_count``, ``context_length``, ``embedding_length``, ``feed_forward_length``,
  ``attention.head_count``, ``attention.head_count_kv``, ``rope.freq_base``, ``attention.layer_norm_rms_epsilon``,
  and ``attention.key_length`` / ``value_length`` when the config (``AutoConfig.to_dict()``) has a ``head_dim``.
  Weights keep HF's orientation (``[out, in]`` rows; ggml lists the shape reversed, ``ne = [in, out]``); 1-D
  tensors and names ending ``_norm.weight`` are F32.
- llama, llama3, mistral → GGUF arch ``llama`` (``MistralForCausalLM`` is registered to ``LlamaModel``;
  llama.cpp has no dense ``mistral`` arch). Rows of ``attn_q`` / ``attn_k`` are reordered within each head
  (``LlamaModel.permute``): HF rows ``[half, i]`` are stored ``[i, half]``, so ggml's adjacent-pair RoPE equals
  HF's rotate-half. Extra keys: ``llama.vocab_size``, ``llama.rope.dimension_count`` (head_dim).
- llama3 (``rope_type: llama3``): the converter writes no RoPE-scaling key for it; it writes a tensor
  ``rope_freqs.weight`` (F32, ``[head_dim / 2]``), one factor per frequency, that ggml divides the frequency by:
  1 where the wavelength ``2π/f`` is under ``original / high_freq_factor``, ``factor`` where it is over
  ``original / low_freq_factor``, ``1 / ((1 - s) / factor + s)`` between, ``s = (original / wavelength -
  low_freq_factor) / (high_freq_factor - low_freq_factor)`` — the same smoothing transformers applies to
  ``inv_freq``. It reads ``original_max_position_embeddings`` from the top level of the config (default 8192),
  not from ``rope_parameters``, so the zoo sets it in both places (32, so that most frequencies are scaled at
  the tests' positions). The one place the pair is not bit-identical: transformers computes the scaled
  ``inv_freq`` directly, ggml divides ``base^(-2i/d)`` by the factor at run time (equal to 1e-6 relative).
- mistral: ``sliding_window`` None (Mistral v0.2+): the converter writes no window for arch ``llama`` and
  llama.cpp would attend to everything.
- qwen2 → ``qwen2``, no reorder (llama.cpp rotates NeoX-style), q/k/v biases as ``attn_{q,k,v}.bias`` (F32);
  no ``key_length`` (Qwen2's config has no ``head_dim``). Hidden 320 here (as Qwen2.5-0.5B's 896, not a
  multiple of 256): K-quants fall back to Q5_0 / Q8_0 (``zoo_quant``).
- qwen3 → ``qwen3``, no reorder; per-head RMSNorm weights ``attn_q_norm`` / ``attn_k_norm`` (``[head_dim]``).
- gemma3 → ``gemma3``, no reorder. Every ``*norm.weight`` (attn_norm, post_attention_norm, ffn_norm,
  post_ffw_norm, attn_q_norm, attn_k_norm, output_norm) is stored as ``1 + w`` (HF's Gemma3RMSNorm scales by
  ``1 + w``). HF names: ``post_attention_layernorm`` → ``post_attention_norm`` (not ``ffn_norm``),
  ``pre_feedforward_layernorm`` → ``ffn_norm``, ``post_feedforward_layernorm`` → ``post_ffw_norm``. The
  embedding scale ``sqrt(hidden)`` is not baked in (both sides multiply at run time; hidden 256 makes it exactly
  16). Keys: ``attention.key_length`` / ``value_length`` (head_dim), ``attention.sliding_window``,
  ``rope.freq_base`` (global layers) and ``rope.freq_base_swa`` (local layers: written by today's converter
  from transformers 5's nested ``rope_parameters``; older files such as the 270M one lack it and llama.cpp then
  uses 10000), ``final_logit_softcapping`` only when set. No key for the sliding-window pattern: llama.cpp
  fixes it at 6 (layer ``i`` is global iff ``i % 6 == 5``) and its attention scale at ``1/sqrt(head_dim)``, so
  the zoo model has 6 layers (5 local, 1 global) and ``query_pre_attn_scalar = head_dim``. Window 16: a
  query at position p sees keys p-15 … p in both (HF ``kv > q - window``, llama.cpp ``q - kv < n_swa``).
  Tied: no ``output.weight``. ``gemma3_softcap``: the same with ``final_logit_softcapping`` 15 (HF caps the
  logits; today's llama.cpp applies the cap only in its graph without sliding-window layers).
- qwen3moe → ``qwen3moe`` (``Qwen3MoeModel``, a ``Qwen2MoeModel``), olmoe → ``olmoe`` (``OlmoeModel``): no
  reorder; ``expert_count``, ``expert_used_count``, and for qwen3moe ``expert_feed_forward_length``
  (``moe_intermediate_size``; OLMoE's experts are ``intermediate_size`` wide); each layer's experts stacked into
  ``ffn_{gate,up,down}_exps`` ``[E, rows, cols]``; the router ``ffn_gate_inp`` F32. No key for the gating:
  llama.cpp renormalises qwen3moe's top-k weights and not olmoe's, fixed per arch. OLMoE's q / k norms are
  ``attn_q_norm`` ``[hidden]`` and ``attn_k_norm`` ``[kv_dim]``.
- granitemoe → ``granitemoe`` (``GraniteMoeModel``, a ``GraniteModel``, a ``LlamaModel``): q / k rows reordered as
  Llama's; ``vocab_size``, ``rope.dimension_count``, the muP keys ``attention.scale``, ``embedding_scale``,
  ``residual_scale``, ``logit_scale``, and ``expert_count`` / ``expert_used_count``; ``input_linear`` split
  into ``ffn_gate_exps`` and ``ffn_up_exps``, ``output_linear`` → ``ffn_down_exps``, ``router.layer`` →
  ``ffn_gate_inp``. (llama.cpp renormalises a softmax over every expert's logit: the softmax over the top-k
  logits of transformers' GraniteMoe, up to rounding.)
- mixtral → ``llama`` (``MixtralForCausalLM`` is registered to ``LlamaModel``): as llama, plus TextModel's
  ``expert_count`` / ``expert_used_count``; ``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2`` stacked into
  ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``, ``block_sparse_moe.gate`` → ``ffn_gate_inp`` (F32). No
  gating key: llama.cpp's llama renormalises the top-k weights, as transformers' Mixtral does.
- granitemoeshared → ``granitemoe`` (``GraniteMoeModel`` takes ``GraniteMoeSharedForCausalLM``): granitemoe's keys
  and tensors, plus ``expert_shared_feed_forward_length`` and ``shared_mlp.input_linear`` split into
  ``ffn_gate_shexp`` / ``ffn_up_shexp``, ``output_linear`` → ``ffn_down_shexp``; no shared-expert gate.
- qwen2moe → ``qwen2moe`` (``Qwen2MoeModel``): Qwen 2's q/k/v biases, no reorder; ``expert_count``,
  ``expert_used_count``, ``expert_feed_forward_length`` and ``expert_shared_feed_forward_length``; routed experts
  stacked as qwen3moe's, the shared expert as ``ffn_{gate,up,down}_shexp`` and its gate ``ffn_gate_inp_shexp``, F32
  ``[hidden]`` (the HF ``[1, hidden]`` row as a vector: transformers' GGUF reader expands it back, "quantized one is
  (2048)"). llama.cpp never renormalises qwen2moe's top-k.
- YaRN (``rope_type: yarn``, any arch; ``TextModel.set_gguf_parameters``): ``rope.scaling.type`` yarn,
  ``rope.scaling.factor``, ``rope.scaling.original_context_length``, and ``rope.scaling.yarn_beta_fast`` /
  ``yarn_beta_slow`` / ``yarn_attn_factor`` when the RoPE dict sets ``beta_fast`` / ``beta_slow`` /
  ``attention_factor`` (else llama.cpp takes 32, 1 and 1, as transformers does). Without ``attention_factor``,
  ``mscale`` or ``mscale_all_dim`` in the dict the attention factor is ``0.1 ln(factor) + 1`` in both engines; with
  one they differ (ringshm refuses the GGUF's ``yarn_attn_factor``, and the converter drops the mscales).
- gptoss → ``gpt-oss`` (``GptOssModel``): no reorder; TextModel's keys (its YaRN ones among them), ``expert_count``,
  ``expert_used_count``, ``sliding_window``, ``expert_feed_forward_length`` (``intermediate_size``); q/k/v/o biases,
  ``attn_sinks.weight`` (``self_attn.sinks`` named as a weight), ``post_attention_layernorm`` →
  ``post_attention_norm`` (the FFN's norm), ``mlp.router`` → ``ffn_gate_inp`` weight and bias; the experts split
  and transposed as ``zoo_experts.add_gptoss_experts`` draws (MXFP4). No key for the gating, the sliding pattern
  (every even layer slides), the SwiGLU's alpha / limit (1.702, 7) or the attention scale: llama.cpp fixes them.
- phi3 → ``phi3``, no reorder; fused ``attn_qkv`` (q rows, then k, then v) and fused ``ffn_up`` (gate rows,
  then up: ``[2 * intermediate, hidden]``), no ``ffn_gate``. Keys: ``rope.scaling.original_context_length``,
  ``rope.dimension_count``, ``attention.sliding_window`` (0 when the config has none).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch


def add_llama_hparams(w: gguf.GGUFWriter, cfg, rope_theta: float) -> None:
    """The Llama hyperparameters a GGUF carries, from a transformers config (BOS 1, EOS 2): the header of the
    small hand-written files some tests build without the zoo's converter."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorder (``LlamaModel.permute``): per head, rows ``[2, D/2]`` → ``[D/2, 2]``.
    Shapes: ``[n_heads * D, ...]`` → same."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of ``permute_qk``: per head, rows ``[D/2, 2]`` → ``[2, D/2]``."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config) -> np.ndarray:
    """The converter's ``rope_freqs.weight`` for ``rope_type: llama3``: fp32 ``[head_dim / 2]`` (module docstring).

    Reads the factors from ``rope_parameters`` and ``original_max_position_embeddings`` from the top level of
    the config dict, as ``LlamaModel.generate_extra_tensors`` does.
    """
    hp = config.to_dict()
    rp = hp["rope_parameters"]
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (rp.get("rope_theta", 10000.0) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rp.get("factor", 8.0), rp.get("low_freq_factor", 1.0), rp.get("high_freq_factor", 4.0)
    old = hp.get("original_max_position_embeddings", 8192)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            s = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return torch.tensor(out, dtype=torch.float32).numpy()


def gguf_name_map(arch: str, n_layers: int) -> gguf.TensorNameMap:
    """gguf-py's (llama.cpp's) HF → GGUF tensor name table for ``arch``."""
    return gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), n_layers)


def gguf_role(gguf_name: str) -> tuple[str, int | None]:
    """``blk.3.attn_q.bias`` → (``attn_q.bias``, 3); ``token_embd.weight`` → (``token_embd``, None)."""
    parts = gguf_name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else None
    rest = parts[2:] if layer is not None else parts
    return (".".join(rest[:-1]) + (".bias" if rest[-1] == "bias" else "")), layer


def write_gguf(path: Path, arch: str, config, file_type: gguf.LlamaFileType, model_name: str,
               tensors: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]) -> None:
    """Write a GGUF: the ``general.*`` keys the converter writes, the model keys its ``set_gguf_parameters``
    writes for ``arch`` from ``config.to_dict()`` (what its ``load_hparams`` reads), then ``tensors``
    ``(name, raw, ggml type)`` in order. No tokenizer keys."""
    hp = config.to_dict()
    n_params = sum(int(np.prod(gguf.quant_shape_from_byte_shape(raw.shape, t) if raw.dtype == np.uint8
                               else raw.shape)) for _, raw, t in tensors)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(model_name)
    w.add_size_label(gguf.size_label(n_params, 0, 0, 0))
    head_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    rp = hp.get("rope_parameters") or {}
    full = rp.get("full_attention", rp)
    if arch == "phi3":  # Phi3MiniModel.set_gguf_parameters (does not call the generic one)
        w.add_context_length(hp["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(hp["original_max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_block_count(hp["num_hidden_layers"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        w.add_rope_dimension_count(int(full.get("partial_rotary_factor", 1.0) * hp["hidden_size"])
                                   // hp["num_attention_heads"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_file_type(file_type)
        w.add_sliding_window(hp.get("sliding_window") or 0)
    else:  # TextModel.set_gguf_parameters, then the family's additions
        w.add_block_count(hp["num_hidden_layers"])
        w.add_context_length(hp["max_position_embeddings"])
        w.add_embedding_length(hp["hidden_size"])
        w.add_feed_forward_length(hp["intermediate_size"])
        w.add_head_count(hp["num_attention_heads"])
        w.add_head_count_kv(hp["num_key_value_heads"])
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":  # the converter's linear scaling keys (llama3 writes rope_freqs)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        if full.get("rope_type") == "yarn":  # TextModel's YaRN keys
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(full["factor"])
            w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
            if full.get("attention_factor") is not None:  # (ringshm refuses such a file: see below)
                w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
            if full.get("beta_fast") is not None:
                w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
            if full.get("beta_slow") is not None:
                w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
        if "sliding_attention" in rp:
            w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
        w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
        if hp.get("head_dim") is not None:
            w.add_key_length(hp["head_dim"])
            w.add_value_length(hp["head_dim"])
        w.add_file_type(file_type)
        if arch == "llama":
            w.add_vocab_size(hp["vocab_size"])
            w.add_rope_dimension_count(head_dim)
        if arch == "granitemoe":  # GraniteModel (a LlamaModel): its muP keys, then LlamaModel's
            w.add_vocab_size(hp["vocab_size"])
            w.add_rope_dimension_count(head_dim)
            w.add_attention_scale(hp["attention_multiplier"])
            w.add_embedding_scale(hp["embedding_multiplier"])
            w.add_residual_scale(hp["residual_multiplier"])
            w.add_logit_scale(hp["logits_scaling"])
        if arch in ("qwen3moe", "olmoe", "granitemoe", "qwen2moe") or hp.get("num_local_experts"):  # expert keys
            w.add_expert_count(hp.get("num_experts", hp.get("num_local_experts")))
            w.add_expert_used_count(hp["num_experts_per_tok"])
            if hp.get("moe_intermediate_size"):
                w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
            if hp.get("shared_expert_intermediate_size"):  # Qwen2MoeModel
                w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
            if hp.get("shared_intermediate_size"):  # GraniteMoeModel, for GraniteMoeSharedForCausalLM
                w.add_expert_shared_feed_forward_length(hp["shared_intermediate_size"])
        if arch == "gpt-oss":  # GptOssModel.set_gguf_parameters
            w.add_sliding_window(hp["sliding_window"])
            w.add_expert_feed_forward_length(hp["intermediate_size"])
        if arch == "gemma3":
            if hp.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(hp["final_logit_softcapping"])
            w.add_sliding_window(hp["sliding_window"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, raw, qtype in tensors:
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
