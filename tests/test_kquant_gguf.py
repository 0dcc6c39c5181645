"""A Q4_K_M-style GGUF (Q4_K with Q6_K for some attn_v / ffn_down and the output, Q5_0 / Q5_K / Q5_1 here and
there) written with the gguf package: its K-quant and Q5 tensors load in their own encoding, run natively, and
give the logits of the transformers model holding the same (dequantized) weights.

gguf-py does not quantize the K-quants, so the blocks are built from random bytes with scales that centre the
weights; the oracle model gets their ``gguf.quants.dequantize`` (un-reordering llama.cpp's Q/K rows).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

from ringshm.model import qmatmul as qm
from ringshm.model.loader import Checkpoint
from ringshm.model.stage_model import StageModel
from zoo_convert import add_llama_hparams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=96, max_position_embeddings=64, rope_theta=10000.0,
             rms_norm_eps=1e-6)
# llama.cpp's Q4_K_M keeps V and half of ffn_down in Q6_K and the output in Q6_K; a few other encodings mixed in
TYPES = {"token_embd.weight": QT.Q4_K, "output.weight": QT.Q6_K,
         "blk.0.attn_q.weight": QT.Q4_K, "blk.0.attn_k.weight": QT.Q4_K, "blk.0.attn_v.weight": QT.Q6_K,
         "blk.0.attn_output.weight": QT.Q4_K, "blk.0.ffn_gate.weight": QT.Q4_K, "blk.0.ffn_up.weight": QT.Q4_K,
         "blk.0.ffn_down.weight": QT.Q6_K,
         "blk.1.attn_q.weight": QT.Q5_K, "blk.1.attn_k.weight": QT.Q5_K, "blk.1.attn_v.weight": QT.Q5_K,
         "blk.1.attn_output.weight": QT.Q5_0, "blk.1.ffn_gate.weight": QT.Q5_1, "blk.1.ffn_up.weight": QT.Q5_1,
         "blk.1.ffn_down.weight": QT.Q4_K}
BLOCK = {QT.Q4_K: (256, 144), QT.Q5_K: (256, 176), QT.Q6_K: (256, 210), QT.Q5_0: (32, 22), QT.Q5_1: (32, 24)}


def _half(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def random_tensor(qtype: QT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes [n, row_bytes] of ``qtype`` whose weights are centred, of size about 0.05."""
    bk, size = BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n, k // bk, size), dtype=np.uint8)
    d = rng.uniform(0.5, 1.5, size=raw.shape[:2])
    if qtype in (QT.Q4_K, QT.Q5_K):  # every sub-block sc = 8, m = 60 (Q4_K) / 120 / 2: w = d (8 q - 60)
        raw[:, :, 0:2], raw[:, :, 2:4] = _half(d * 1e-3), _half(d * (1e-3 if qtype == QT.Q4_K else 2e-3))
        raw[:, :, 4:8], raw[:, :, 8:12], raw[:, :, 12:16] = 8, 252, 200
    elif qtype == QT.Q6_K:  # random int8 scales, q - 32 centred
        raw[:, :, 208:210] = _half(d * 2e-5)
    elif qtype == QT.Q5_0:
        raw[:, :, 0:2] = _half(d * 3e-3)
    else:  # Q5_1: w = d q + m, m = -15.5 d
        raw[:, :, 0:2], raw[:, :, 2:4] = _half(d * 3e-3), _half(d * 3e-3 * -15.5)
    return raw.reshape(n, -1)


def _reorder(t: torch.Tensor, n_head: int, inverse: bool = False) -> torch.Tensor:
    """llama.cpp's Q/K row order per head: [2, D/2] (rotate-half) <-> [D/2, 2] (adjacent pairs)."""
    d2 = t.shape[0] // n_head // 2
    shape = (n_head, d2, 2, *t.shape[1:]) if inverse else (n_head, 2, d2, *t.shape[1:])
    return t.reshape(shape).transpose(1, 2).reshape(t.shape)


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory):
    """(path of the GGUF, the transformers model with the same weights)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("kq") / "q4_k_m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_hparams(w, cfg, SHAPE["rope_theta"])
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, qtype in TYPES.items():
            if name == "token_embd.weight":
                p = params["model.embed_tokens.weight"]
            elif name == "output.weight":
                p = params["lm_head.weight"]
            else:
                _, i, kind, _ = name.split(".")
                p = params[f"model.layers.{i}.{hf[kind]}.weight"]
            raw = random_tensor(qtype, p.shape[0], p.shape[1], rng)
            wt = torch.from_numpy(quants.dequantize(raw, qtype)).reshape(p.shape)
            if ".attn_q." in name or ".attn_k." in name:
                heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
                wt = _reorder(wt, heads, inverse=True)
            p.copy_(wt)
            w.add_tensor(name, raw, raw_dtype=qtype)
        for name, p in params.items():  # norms: fp32, not all ones
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
                gname = ("output_norm.weight" if name == "model.norm.weight" else
                         f"blk.{name.split('.')[2]}." + ("attn_norm" if "input_layernorm" in name else "ffn_norm")
                         + ".weight")
                w.add_tensor(gname, p.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


def test_k_quant_and_q5_tensors_load_in_their_own_encoding(q4_k_m):
    path, _ = q4_k_m
    st = Checkpoint.open(path).load_stage((0, 2), is_first=True, is_last=True)
    l0, l1 = st.layers
    assert (l0.wq.qtype, l0.wv.qtype, l0.w_down.qtype, l1.wq.qtype, l1.wo.qtype, l1.w_gate.qtype) == \
        (qm.Q4_K, qm.Q6_K, qm.Q6_K, qm.Q5_K, qm.Q5_0, qm.Q5_1)
    assert st.embed.qtype == qm.Q4_K and st.lm_head.qtype == qm.Q6_K
    assert l0.wv.data.numel() == 128 * 256 // 256 * 210  # the file's blocks, not an fp32 copy


@torch.inference_mode()
def test_a_q4_k_m_style_gguf_runs_natively_and_gives_the_transformers_logits(q4_k_m):
    path, model = q4_k_m
    stage = StageModel.from_path(path, max_rows=1, max_seq_len=32)
    assert stage.native
    l0, l1 = stage.layers
    # layer 0 mixes Q4_K (q, k) and Q6_K (v): three packed weights, none widened to F32
    assert (l0.wqkv.qtype, l0.wk.qtype, l0.wv.qtype, l1.wqkv.qtype, l1.wk) == (qm.Q4_K, qm.Q4_K, qm.Q6_K,
                                                                               qm.Q5_K, None)
    packed = [pw for layer in stage.layers for pw in (layer.wqkv, layer.wk, layer.wv, layer.wo, layer.w_gate_up,
                                                      layer.w_down) if pw is not None] + [stage.lm_head]
    assert all(pw.qtype != qm.F32 for pw in packed)
    prompt = torch.randint(0, SHAPE["vocab_size"], (9,), generator=torch.Generator().manual_seed(1))
    ref = model(prompt[None]).logits[0]  # [T, vocab]
    out = stage.forward(prompt, row=0, start=0, all_positions=True, return_logits=True)
    scale = ref.abs().max().item()
    assert (out.logits - ref[-1]).abs().max().item() <= 1e-4 * scale
    nxt = torch.tensor([5])
    ref2 = model(torch.cat([prompt, nxt])[None]).logits[0, -1]
    out2 = stage.forward(nxt, row=0, start=9, return_logits=True)
    assert (out2.logits - ref2).abs().max().item() <= 1e-4 * scale
