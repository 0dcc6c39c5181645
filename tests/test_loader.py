"""Loading: GGUF metadata and dequantization, HF safetensors directories, and the errors that name the thing.

Tiny checkpoints are written by the tests themselves: a random transformers model saved with
``save_pretrained`` (HF directory), or the same weights written as a GGUF with llama.cpp's Q/K row reorder.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm.errors import LayerRangeError, MissingTensor, UnsupportedArchitecture, UnsupportedQuantType
from ringshm.model import families
from ringshm.model.dequant import dequantize
from ringshm.model.loader import Checkpoint, read_config
from ringshm.model.reference import run_stages
from ringshm.model.stage_model import StageModel
from zoo_convert import add_llama_hparams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128,
            rope_theta=10000.0, rms_norm_eps=1e-6)


def _tiny_hf_model(arch: str, tie: bool, seed: int = 0):
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    cfg = cls_cfg(**TINY, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    model = cls_model(cfg).eval()
    with torch.no_grad():  # norms and biases start at 1 / 0; make them count
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _save_tiny_hf(tmp_path, arch: str, tie: bool):
    model = _tiny_hf_model(arch, tie)
    model.save_pretrained(str(tmp_path))
    return model


@torch.inference_mode()
def _assert_stage_matches_hf(stage: StageModel, model, n_tokens: int = 11, atol: float = 1e-4) -> None:
    prompt = torch.randint(0, TINY["vocab_size"], (n_tokens,), generator=torch.Generator().manual_seed(1))
    ref = model(prompt[None]).logits[0]  # [T, vocab]
    out = stage.forward(prompt, row=0, start=0, all_positions=True, return_logits=True)
    assert torch.equal(out.token_ids, ref.argmax(-1))
    assert (out.logits - ref[-1]).abs().max().item() < atol
    # one decode step after the prompt reads the KV the prefill wrote
    nxt = out.token_ids[-1:]
    ref2 = model(torch.cat([prompt, nxt])[None]).logits[0, -1]
    out2 = stage.forward(nxt, row=0, start=n_tokens, return_logits=True)
    assert (out2.logits - ref2).abs().max().item() < atol


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("mistral", False), ("qwen2", False)])
def test_hf_safetensors_directory_gives_the_logits_of_the_transformers_model(tmp_path, arch, tie):
    model = _save_tiny_hf(tmp_path, arch, tie)
    cfg = read_config(tmp_path)
    assert (cfg.arch, cfg.n_layers, cfg.n_kv_heads, cfg.tie_embeddings) == (arch, 3, 2, tie)
    assert cfg.attention_bias == (arch == "qwen2")
    stage = StageModel.from_path(tmp_path, max_rows=1, max_seq_len=64)
    _assert_stage_matches_hf(stage, model)


def test_hf_directory_split_into_stages_equals_one_stage(tmp_path):
    _save_tiny_hf(tmp_path, "qwen2", tie=True)
    ckpt = Checkpoint.open(tmp_path)
    whole = StageModel.from_path(tmp_path, max_rows=1, max_seq_len=32, checkpoint=ckpt)
    parts = [StageModel.from_path(tmp_path, r, max_rows=1, max_seq_len=32, checkpoint=ckpt)
             for r in [(0, 1), (1, 3)]]
    assert [(p.is_first, p.is_last) for p in parts] == [(True, False), (False, True)]
    prompt = torch.arange(5, 14)
    a = whole.forward(prompt, 0, 0, return_logits=True)
    b = run_stages(parts, prompt, 0, 0, return_logits=True)
    assert torch.equal(a.logits, b.logits)


def _write_tiny_gguf(path, model, arch: str = "llama", drop: str | None = None,
                     raw_override: dict | None = None) -> None:
    """Write ``model`` as a GGUF the way llama.cpp's converter does for Llama: Q/K rows reordered per head."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    add_llama_hparams(w, cfg, TINY["rope_theta"])

    def reorder(t: torch.Tensor, n_head: int) -> torch.Tensor:
        # the converter's direction: per head, rows [2, D/2] (rotate-half) -> [D/2, 2] (adjacent pairs)
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    sd = model.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    hf = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for a, b in hf.items():
            names[f"model.layers.{i}.{a}.weight"] = f"blk.{i}.{b}.weight"
    for hf_name, gg_name in names.items():
        t = sd[hf_name].float()
        if ".attn_q." in gg_name:
            t = reorder(t, cfg.num_attention_heads)
        elif ".attn_k." in gg_name:
            t = reorder(t, cfg.num_key_value_heads)
        if gg_name == drop:
            continue
        if raw_override and gg_name in raw_override:
            qtype = raw_override[gg_name]
            w.add_tensor(gg_name, quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gg_name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_with_llama_cpp_row_order_gives_the_logits_of_the_transformers_model(tmp_path):
    model = _tiny_hf_model("llama", tie=True)
    _write_tiny_gguf(tmp_path / "tiny.gguf", model)
    cfg = read_config(tmp_path / "tiny.gguf")
    assert (cfg.arch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == ("llama", 4, 2, 16, True)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_seq_len) == (1, (2,), 128)
    _assert_stage_matches_hf(StageModel.from_path(tmp_path / "tiny.gguf", max_rows=1, max_seq_len=64), model)


def test_gguf_loaded_without_undoing_the_row_order_would_not_match(tmp_path, monkeypatch):
    model = _tiny_hf_model("llama", tie=True)
    _write_tiny_gguf(tmp_path / "tiny.gguf", model)
    monkeypatch.setattr(families, "GGUF_PERMUTED_QK", set())
    stage = StageModel.from_path(tmp_path / "tiny.gguf", max_rows=1, max_seq_len=64)
    with pytest.raises(AssertionError):
        _assert_stage_matches_hf(stage, model)


def test_gguf_of_an_unsupported_architecture_is_refused_by_name(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_model("llama", tie=True), arch="gpt2")
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'"):
        Checkpoint.open(tmp_path / "tiny.gguf")


def test_hf_directory_of_an_unsupported_architecture_is_refused_by_name(tmp_path):
    _save_tiny_hf(tmp_path, "llama", tie=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="gpt_neox"):
        read_config(tmp_path)


def test_a_missing_tensor_is_named_when_the_checkpoint_opens_before_any_stage_loads(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf", _tiny_hf_model("llama", tie=True), drop="blk.1.ffn_up.weight")
    with pytest.raises(MissingTensor, match=r"blk\.1\.ffn_up\.weight.*layer 1 w_up"):
        Checkpoint.open(tmp_path / "tiny.gguf")


def test_a_missing_lm_head_of_an_untied_hf_model_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _save_tiny_hf(tmp_path, "llama", tie=False)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingTensor, match="lm_head.weight"):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize("bad", [(0, 4), (2, 2), (-1, 2), (3, 1), range(0, 3, 2)])
def test_a_layer_range_outside_the_model_is_refused(tmp_path, bad):
    _save_tiny_hf(tmp_path, "llama", tie=True)
    ckpt = Checkpoint.open(tmp_path)
    with pytest.raises(LayerRangeError, match="3 layers"):
        ckpt.load_stage(bad, is_first=True, is_last=True)


def test_default_gguf_metadata_gives_the_smollm2_config(checkpoint):
    cfg = checkpoint.config
    assert (cfg.arch, cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert (cfg.intermediate, cfg.vocab, cfg.rope_theta, cfg.tie_embeddings) == (1536, 49152, 1e5, True)
    assert cfg.rms_eps == pytest.approx(1e-5) and cfg.max_seq_len == 8192
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.attention_bias) == (1, (2,), False)


def test_the_last_stage_of_a_tied_model_gets_token_embd_as_its_head(checkpoint):
    last = checkpoint.load_stage((29, 30), is_first=False, is_last=True)
    assert last.embed is None and last.lm_head.shape == (49152, 576)
    assert len(last.layers) == 1 and last.layers[0].wk.shape == (192, 576)
    both = checkpoint.load_stage((29, 30), is_first=True, is_last=True)
    assert both.lm_head is both.embed  # one tensor, not two copies


# ---- dequantization -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.BF16])
def test_dequantize_equals_gguf_reference_bitwise(qtype):
    x = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32) * 2
    data = quants.quantize(x, qtype)
    ours = dequantize(data, qtype, (48, 96))
    ref = torch.from_numpy(quants.dequantize(data, qtype).astype(np.float32))
    assert ours.dtype == torch.float32 and torch.equal(ours, ref)


def test_dequantize_q4_1_block_gives_known_values():
    # one block: d = 0.5, m = -1.0, qs[j] = j | (15 - j) << 4 -> w[j] = 0.5 j - 1, w[16 + j] = 0.5 (15 - j) - 1
    block = np.concatenate([np.array([0.5, -1.0], dtype=np.float16).view(np.uint8),
                            np.array([j | (15 - j) << 4 for j in range(16)], dtype=np.uint8)])
    out = dequantize(block, QT.Q4_1, (32,))
    expect = torch.tensor([0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)])
    assert torch.equal(out, expect)


@pytest.mark.parametrize("dtype,qtype", [(np.float32, QT.F32), (np.float16, QT.F16)])
def test_float_tensors_load_unchanged(dtype, qtype):
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(dtype)
    assert torch.equal(dequantize(x, qtype, (3, 32)), torch.from_numpy(x.astype(np.float32)))


def test_an_unsupported_quant_type_is_named():
    with pytest.raises(UnsupportedQuantType, match="Q8_1.*'blk.0.attn_q.weight'|'blk.0.attn_q.weight'.*Q8_1"):
        dequantize(np.zeros(36, dtype=np.uint8), QT.Q8_1, (32,), name="blk.0.attn_q.weight")


def test_a_quantized_tiny_gguf_keeps_each_weight_in_its_encoding(tmp_path):
    model = _tiny_hf_model("llama", tie=True)
    _write_tiny_gguf(tmp_path / "q.gguf", model,
                     raw_override={"blk.0.ffn_up.weight": QT.Q4_1, "blk.1.attn_v.weight": QT.Q8_0,
                                   "blk.2.ffn_down.weight": QT.Q4_0})
    w = Checkpoint.open(tmp_path / "q.gguf").load_stage((0, 3), True, True)
    up = model.model.layers[0].mlp.up_proj.weight.detach().numpy()
    ref = torch.from_numpy(quants.dequantize(quants.quantize(up, QT.Q4_1), QT.Q4_1))
    assert (w.layers[0].w_up.qtype, w.layers[1].wv.qtype, w.layers[2].w_down.qtype) == (QT.Q4_1, QT.Q8_0, QT.Q4_0)
    assert w.layers[0].w_up.data.numel() == 96 * 64 // 32 * 20  # the file's blocks, not an fp32 copy
    assert torch.equal(w.layers[0].w_up.dequantize(), ref)
    assert (w.layers[1].wv.dequantize() - model.model.layers[1].self_attn.v_proj.weight).abs().max() < 1e-2
    assert w.layers[2].w_down.shape == (64, 96)


# ---- tokenizer ------------------------------------------------------------------------------------------


def test_the_gguf_tokenizer_is_cached_and_carries_the_chat_template(model_path, tokenizer):
    from ringshm.model.tokenizer import DEFAULT_CACHE_DIR, load_tokenizer, tokenizer_cache_key

    entry = DEFAULT_CACHE_DIR / "tokenizers" / tokenizer_cache_key(model_path)
    assert (entry / "tokenizer.json").is_file()  # the session fixture converted or reused it
    again = load_tokenizer(model_path)  # from the cache: fast, and the same tokenizer
    text = "Shared memory rings: head, tail, <|im_start|> and all."
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    chat = again.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert (again.bos_token_id, again.eos_token_id) == (1, 2)


def test_a_tokenizer_for_a_path_that_is_no_model_is_refused(tmp_path):
    from ringshm.model.tokenizer import load_tokenizer

    with pytest.raises(FileNotFoundError, match="neither"):
        load_tokenizer(tmp_path / "nothing.bin")
