"""The per-row kernels (csrc/kernels.c via ringshm.model.kernels): RoPE against the plain torch reference and
transformers', RMSNorm and the MLP gates against torch in fp64 and batch-invariant. Paged KV and attention are
tests/test_attention.py."""

from __future__ import annotations

import math

import pytest
import torch

from ringshm.model import kernels
from test_matmul import rows_match_alone  # the matmul tests' bitwise row-alone check, over their M sweep

ATOL = RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row(hkv: int, smax: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(hkv, smax, d, generator=g), torch.randn(hkv, smax, d, generator=g)


# --- RoPE -----------------------------------------------------------------------------------------


def test_rope_of_position_0_is_the_identity():
    cos, sin = kernels.rope_tables(64, 16, 1e5)
    x = torch.randn(1, 3, 64, generator=_gen(8))
    assert torch.equal(kernels.apply_rope(x, 0, cos, sin), x)


def test_rope_tables_follow_theta_to_the_minus_2i_over_d():
    cos, sin = kernels.rope_tables(8, 5, 10000.0)
    assert cos.shape == sin.shape == (5, 4) and cos.dtype == torch.float32
    angle = 3 * 10000.0 ** (-2 / 8)  # position 3, pair 1
    assert cos[3, 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    assert sin[3, 1].item() == pytest.approx(math.sin(angle), abs=1e-6)


def test_rope_rotates_pairs_i_and_i_plus_half_d():
    cos, sin = kernels.rope_tables(4, 4, 100.0)
    x = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])  # only dim 0 set: it rotates into dim 2 (its pair), never dim 1
    y = kernels.apply_rope(x, 2, cos, sin)[0, 0]
    assert y[1].item() == 0.0 and y[3].item() == 0.0
    assert y[0].item() == pytest.approx(math.cos(2.0)) and y[2].item() == pytest.approx(math.sin(2.0))


@pytest.mark.parametrize("d", [32, 64, 6])
def test_apply_rope_matches_the_torch_reference_and_keeps_norms(d):
    cos, sin = kernels.rope_tables(d, 100, 1e5)
    x = torch.randn(7, 5, d, generator=_gen(d))
    y = kernels.apply_rope(x, 50, cos, sin)
    torch.testing.assert_close(y, kernels.apply_rope_reference(x, 50, cos, sin), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    assert not torch.equal(y, x)


@pytest.mark.slow  # importing transformers' Llama takes seconds; the rest of this file runs in about two
def test_rope_matches_transformers_llama_rotary_embedding():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=1e5,
                               max_position_embeddings=64)
    rotary = llama.LlamaRotaryEmbedding(config=config)
    x = torch.randn(1, 9, 6, 64, generator=_gen(9))  # [B, H, T, D], HF layout
    pos = torch.arange(10, 16)[None]
    hf_cos, hf_sin = rotary(x, pos)
    want, _ = llama.apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    cos, sin = kernels.rope_tables(64, 64, 1e5)
    got = kernels.apply_rope(x[0].transpose(0, 1).contiguous(), 10, cos, sin)  # [T, H, D]
    torch.testing.assert_close(got, want[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


# --- RMSNorm and the MLP gates ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [576, 64, 40])
def test_rms_norm_is_close_to_torch_and_batch_invariant(k):
    x, w = torch.randn(33, k) * 3, torch.randn(k)
    out = kernels.rms_norm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.double(), (k,), w.double(), 1e-5)
    assert (out.double() - ref).abs().max().item() < 1e-5
    assert rows_match_alone(lambda a: kernels.rms_norm(a, w, 1e-5), torch.randn(256, k))


@pytest.mark.parametrize("inter", [1536, 96, 21])
def test_silu_mul_is_close_to_torch_and_batch_invariant(inter):
    gu = torch.randn(33, 2 * inter) * 6
    gu[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    out = kernels.act_mul(gu)
    g, u = gu.double().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    assert ((out.double() - ref).abs() <= 1e-6 * (1 + ref.abs())).all()
    assert rows_match_alone(kernels.act_mul, torch.randn(256, 2 * inter))


@pytest.mark.parametrize("inter", [1536, 96, 21])
def test_gelu_tanh_mul_is_close_to_torch_and_batch_invariant(inter):
    gu = torch.randn(33, 2 * inter) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -3.0])
    out = kernels.act_mul(gu, "gelu_tanh")
    g, u = gu.double().chunk(2, dim=-1)
    ref = torch.nn.functional.gelu(g, approximate="tanh") * u
    assert ((out.double() - ref).abs() <= 2e-6 * (1 + ref.abs())).all()
    assert rows_match_alone(lambda a: kernels.act_mul(a, "gelu_tanh"), torch.randn(256, 2 * inter))


@pytest.mark.parametrize("inter", [1536, 96, 21])
def test_swiglu_oai_mul_is_close_to_transformers_and_batch_invariant(inter):
    """gpt-oss's clamped SwiGLU: the gate clamped above, up on both sides, (up + 1) times the gate's swish."""
    gu = torch.randn(33, 2 * inter) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, 6.9])  # up: past either limit, inside
    gu[0, inter:inter + 4] = torch.tensor([100.0, -100.0, 7.5, -7.5])
    out = kernels.act_mul(gu, "swiglu_oai", 1.702, 7.0)
    g, u = gu.double().chunk(2, dim=-1)
    g = g.clamp(max=7.0)
    ref = (u.clamp(-7.0, 7.0) + 1) * (g * torch.sigmoid(g * 1.702))  # GptOssExperts._apply_gate, de-interleaved
    assert ((out.double() - ref).abs() <= 2e-6 * (1 + ref.abs())).all()
    assert rows_match_alone(lambda a: kernels.act_mul(a, "swiglu_oai", 1.702, 7.0), torch.randn(256, 2 * inter) * 6)
    nan = torch.full((1, 2 * inter), float("nan"))
    assert torch.isnan(kernels.act_mul(nan, "swiglu_oai")).all()  # the clamps keep a NaN, as torch.clamp does
    with pytest.raises(ValueError):
        kernels.act_mul(gu, "swiglu_oai", 1.702, 0.0)  # a limit of 0 clamps everything away: refused


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
def test_a_gate_gives_an_element_the_same_bits_in_a_whole_vector_and_in_a_row_tail(activation):
    """The gates read whole vectors from the row and a row's last < 16 columns through zero-padded copies
    (csrc/kernels_rows.inc, gate_rows): the same (gate, up) pair must come out the same in either place, and in any
    lane. Pairs of 48 columns (3 whole vectors) are laid out again as rows of 15 (a tail alone) and of 31 (a vector
    and a tail of 15) starting at every column, so each pair runs in a whole vector and in every tail lane it can."""
    g, u = torch.randn(64, 48) * 8, torch.randn(64, 48) * 4
    g[0, 18:24] = torch.tensor([-100.0, 100.0, 0.0, -0.0, 7.5, float("nan")])
    whole = kernels.act_mul(torch.cat([g, u], 1), activation)
    for width in (15, 31):
        cols = [(c, c + width) for c in range(0, 48 - width + 1)]
        gu = torch.cat([torch.cat([g[:, a:b], u[:, a:b]], 1) for a, b in cols])
        out = kernels.act_mul(gu, activation)
        want = torch.cat([whole[:, a:b] for a, b in cols])
        assert torch.equal(out.view(torch.int32), want.view(torch.int32))
