"""The opt-in 8-bit-activation matmul (csrc/matmul.h's 8-bit contract, ``EngineConfig.matmul_activations="int8"``).

Kernel: the quantized rows follow the documented rules bit for bit (a numpy copy of them); the product equals the
contract's sum (an fp64 sum over the same integers and scales); every ISA path (VNNI included) and thread count gives
the portable path's bits, and each row its bits alone; non-finite input stays in its own row. Model: a stream's
greedy tokens are the same beside batch-mates, in chunks and over two stages, dense and MoE, and through the engine's
stage processes; and they stay near fp32's (the contract is not the oracle's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringshm._C import lib
from ringshm.config import EngineConfig
from ringshm.model import qmatmul as qm
from ringshm.model.reference import greedy_generate
from ringshm.transport.messages import WANT_LAST, WANT_LOGITS
from test_families import MAX_SEQ, N_NEW, PROMPT_LEN, _stages, batched_greedy
from test_matmul import Q_BYTES, kfit, make_weight
from zoo import prompt_ids

QUANT_TYPES = [qm.Q4_0, qm.Q4_1, qm.Q5_0, qm.Q5_1, qm.Q8_0, qm.Q4_K, qm.Q5_K, qm.Q6_K, qm.MXFP4]
Q8_ISAS = [i for i in (lib.RINGSHM_ISA_PORTABLE, lib.RINGSHM_ISA_AVX2, lib.RINGSHM_ISA_AVX512,
                       lib.RINGSHM_ISA_AVX512_VNNI) if lib.ringshm_isa_supported(i)]
BLOCK_BYTES = 48


def quantize_reference(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """matmul.h's rules in numpy: per row and block of 32, (d, s = d * sum of q, xs [2], q [32] in the nibble words'
    order)."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    bits = xb.view(np.uint32) & np.uint32(0x7FFFFFFF)
    amax_bits = bits.max(-1)
    amax = amax_bits.view(np.float32)
    ok = (amax_bits < 0x7F800000) & (amax_bits >= 0x03800000)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(ok, np.float32(127.0) / np.where(ok, amax, np.float32(1)), np.float32(0)).astype(np.float32)
        q = np.rint((xb * inv[..., None]).astype(np.float32)).clip(-127, 127)
    q = np.where(ok[..., None], q, 0).astype(np.int8)
    d = np.where(amax_bits >= 0x7F800000, np.float32(np.nan),
                 np.where(ok, (amax / np.float32(127.0)).astype(np.float32), np.float32(0))).astype(np.float32)
    xs = np.stack([q[..., :16].astype(np.int32).sum(-1), q[..., 16:].astype(np.int32).sum(-1)], -1)
    s = (d * xs.sum(-1).astype(np.float32)).astype(np.float32)  # the quantized block's sum
    order = [i for g in range(4) for i in [8 * g + 2 * c for c in range(4)] + [8 * g + 2 * c + 1 for c in range(4)]]
    return d, s, xs, q[..., order]


def unpack_rows(xq: torch.Tensor, m: int, k: int) -> tuple[np.ndarray, ...]:
    raw = xq.numpy().reshape(m, k // 32, BLOCK_BYTES)
    d = raw[..., 0:4].copy().view(np.float32)[..., 0]
    s = raw[..., 4:8].copy().view(np.float32)[..., 0]
    xs = raw[..., 8:16].copy().view(np.int32)
    q = raw[..., 16:48].copy().view(np.int8)
    return d, s, xs, q


def test_quantized_rows_follow_the_documented_rules_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=g) * torch.logspace(-3, 3, 256)[torch.randperm(256, generator=g)]
    x[1, 32:64] = 0.0  # a zero block
    x[2, 0:32] = 1e-37  # below 2^-120: quantized as zeros
    x[2, 64] = float("inf")
    x[3, 100] = float("nan")
    x[4, 128:160] = torch.tensor([2.5, -2.5, 0.5, -0.5] * 8) * (127 / 2.5) / 127  # ties at x / d = +-2.5 ...
    want = quantize_reference(x)
    for isa in Q8_ISAS:
        for threads in (1, 2):
            got = unpack_rows(qm.quantize_rows(x.contiguous(), threads, isa), 6, 256)
            for name, a, b in zip(("d", "s", "xs", "q"), got, want):
                assert np.array_equal(a, b, equal_nan=True), (name, isa, threads)


def test_quantizing_a_k_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        qm.quantize_rows(torch.zeros(2, 48))


def _contract(raw: qm.RawWeight, exact: torch.Tensor, qtype: int, x: torch.Tensor) -> torch.Tensor:
    """The 8-bit contract's sum in fp64: each row's blocks dequantized from their integers (d * q) times the
    weight's part without its min, plus the min part times the quantized block's sum s."""
    m, k = x.shape
    d, s, _, q = quantize_reference(x)
    order = [i for g in range(4) for i in [8 * g + 2 * c for c in range(4)] + [8 * g + 2 * c + 1 for c in range(4)]]
    q_nat = np.empty_like(q)
    q_nat[..., order] = q
    xd = torch.from_numpy(q_nat.astype(np.float64) * d[..., None].astype(np.float64)).reshape(m, k)
    w = exact.double()
    if qtype not in Q_BYTES:
        return xd @ w.T
    size = raw.data.numel() // raw.n // (k // qm.block_k(qtype))
    blocks = raw.data.numpy().reshape(raw.n, -1, size).copy()
    blocks[:, :, Q_BYTES[qtype]] = 0  # what is left is the min term alone
    from gguf import GGMLQuantizationType as QT
    from gguf import quants
    mins = torch.from_numpy(quants.dequantize(blocks.reshape(raw.n, -1), QT(qtype))).reshape(raw.n, k).double()
    min_per_block = mins.reshape(raw.n, k // 32, 32)[:, :, 0]  # one min per block of 32
    return xd @ (w - mins).T + torch.from_numpy(s.astype(np.float64)) @ min_per_block.T


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=qm.type_name)
def test_the_product_is_the_8_bit_contracts_sum_and_near_the_fp32_product(qtype):
    # 9 panels: a full group of 8 (the register path at 1 and 3 rows, AVX-512) and a group of one (the slab), each
    # checked against the contract by itself, not against another copy of the same loops
    n, k = 144, kfit(qtype, 512)
    raw, exact, _ = make_weight(qtype, n, k, seed=4)
    pw = qm.PackedWeight(raw)
    for m in (1, 3, 7):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(5 + m))
        got = pw.matmul(x, activations="int8").double()
        want = _contract(raw, exact, qtype, x)
        for cols in (slice(0, 128), slice(128, n)):
            assert float((got[:, cols] - want[:, cols]).norm() / want[:, cols].norm()) < 1e-6, (m, cols)
        fp32 = pw.matmul(x).double()
        assert float((got - fp32).norm() / fp32.norm()) < 1e-2  # 8-bit rows: ~5e-3 on random data, every type


def _raw_q8_0_with_minus_128(n: int, k: int) -> qm.RawWeight:
    """Q8_0 from random bytes (sane scales): gguf's quantizer never writes -128, the sign trick's edge."""
    rng = np.random.default_rng(11)
    raw = rng.integers(0, 256, size=(n, k // 32, 34), dtype=np.uint8)
    raw[:, :, 2:][rng.random(raw[:, :, 2:].shape) < 0.3] = 0x80
    raw[:, :, 0:2] = rng.uniform(-0.01, 0.01, size=(n, k // 32)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return qm.RawWeight.from_bytes(qm.Q8_0, n, k, raw.reshape(-1))


@pytest.mark.parametrize("qtype", [*QUANT_TYPES, "Q8_0-128"], ids=lambda t: t if isinstance(t, str) else
                         qm.type_name(t))
def test_every_path_and_thread_count_gives_the_portable_bits_and_each_row_its_bits_alone(qtype):
    """Every ISA copy named explicitly (isa 2 is the AVX-512BW copy even where VNNI + VBMI exist: the default picks
    those), at 40 rows (the slab) and at 1-17 rows, where a full group of 8 panels takes the register path on
    AVX-512 (one tile of up to 3 rows, or on the VNNI copy several: to 16 rows for the 4-bit nibble types, 8 for
    the assembled bytes and MXFP4, 3 for Q8_0; csrc/matmul_q8.inc's q8_rows_max) and the slab past it (the AVX2 and
    portable copies, the base, always the slab)."""
    # 25 panels, the last one half-filled: 3 full groups of 8 (each group's output at its own columns), then one
    # alone; K of 4 super-blocks
    n, k = 392, kfit(qm.Q8_0 if qtype == "Q8_0-128" else qtype, 1024)
    raw = _raw_q8_0_with_minus_128(n, k) if qtype == "Q8_0-128" else make_weight(qtype, n, k, seed=6)[0]
    pw = qm.PackedWeight(raw)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(7))
    base = pw.matmul(x, activations="int8", isa=lib.RINGSHM_ISA_PORTABLE, threads=1)
    for isa in Q8_ISAS:
        for threads in (1, 2, 3):
            assert torch.equal(pw.matmul(x, activations="int8", isa=isa, threads=threads), base), (isa, threads)
        for m in (1, 2, 3, 4, 5, 6, 8, 9, 16, 17):
            for threads in (1, 2):
                got = pw.matmul(x[m:2 * m], activations="int8", isa=isa, threads=threads)
                assert torch.equal(got, base[m:2 * m]), (isa, m, threads)
    for m in (1, 2, 3, 4, 5, 7, 8, 17, 33):
        got = pw.matmul(x[:m], activations="int8", threads=2)
        assert torch.equal(got, base[:m]), m
    for r in (0, 1, 21, 39):
        assert torch.equal(pw.matmul(x[r:r + 1], activations="int8"), base[r:r + 1]), r


def test_bias_and_residual_are_one_rounded_add_each_after_the_sum():
    raw, _, _ = make_weight(qm.Q4_K, 144, 256, seed=8)  # 9 panels: one row takes the register path, then the slab
    bias = torch.randn(144)
    plain, with_bias = qm.PackedWeight(raw), qm.PackedWeight(raw, bias)
    for m in (1, 5):
        x = torch.randn(m, 256)
        res = torch.randn(m, 144 + 7)[:, :144]  # a row stride past n (ldr = 151)
        for isa in Q8_ISAS:
            want = (plain.matmul(x, activations="int8", isa=isa) + bias) + res
            assert torch.equal(with_bias.matmul(x, residual=res, activations="int8", isa=isa), want), (m, isa)


@pytest.mark.parametrize("m", [3, 4, 9])  # Q6_K on AVX-512: 3 rows one tile of the register path, 4 two, 9 the slab
def test_a_non_finite_input_row_poisons_its_own_outputs_only(m):
    raw, _, _ = make_weight(qm.Q6_K, 128, 256, seed=9)
    pw = qm.PackedWeight(raw)
    x = torch.randn(m, 256)
    clean = pw.matmul(x, activations="int8")
    x[2, 7] = float("nan")
    x[1, 200] = float("inf")
    got = pw.matmul(x, activations="int8")
    assert not got[1].isfinite().any() and not got[2].isfinite().any()
    finite = [r for r in range(m) if r not in (1, 2)]
    assert torch.equal(got[finite], clean[finite])


def test_a_float_weight_runs_the_fp32_contract_either_way():
    raw, _, _ = make_weight(qm.F16, 32, 96, seed=10)
    pw = qm.PackedWeight(raw)
    x = torch.randn(3, 96)
    assert torch.equal(pw.matmul(x, activations="int8"), pw.matmul(x))
    assert torch.equal(pw.matmul(x, activations="int8", isa=lib.RINGSHM_ISA_PORTABLE), pw.matmul(x))
    if lib.ringshm_isa_supported(lib.RINGSHM_ISA_AVX512_VNNI):  # names the 8-bit path; the fp32 one runs AVX-512
        assert torch.equal(pw.matmul(x, activations="int8", isa=lib.RINGSHM_ISA_AVX512_VNNI), pw.matmul(x))
    with pytest.raises(ValueError, match="activations must be one of"):
        pw.matmul(x, activations="int4")


def test_int8_is_refused_for_a_model_whose_stages_run_the_torch_path(zoo):
    from ringshm.engine.engine import Engine
    from ringshm.model.stage_model import check_int8_runs_native

    model = zoo("llama", "f32", head_dim=40)  # not a multiple of 16: the C layers refuse it, the torch path runs
    cfg = _stages(model.gguf_path, ())[0].config
    with pytest.raises(ValueError, match="head_dim 40"):
        check_int8_runs_native(cfg, "int8")
    check_int8_runs_native(cfg, "float32")
    with pytest.raises(ValueError, match="torch path"):
        Engine(model=str(model.gguf_path), stages=1, progress=False, matmul_activations="int8")


def test_the_engine_config_refuses_an_unknown_value_and_int8_off_the_cpu_float32_path():
    with pytest.raises(ValueError, match="matmul_activations must be one of"):
        EngineConfig(matmul_activations="fp16")
    with pytest.raises(ValueError, match="row_prefetch must be True, False or None"):
        EngineConfig(row_prefetch="on")
    for bad in (dict(dtype="bfloat16"), dict(device="cuda")):  # the torch path would ignore it silently
        with pytest.raises(ValueError, match="device='cpu' and dtype='float32'"):
            EngineConfig(matmul_activations="int8", **bad)


# ------------------------------------------------------------------------------------------------ whole models
def _stages_int8(path, splits=()):
    return _stages(path, splits, activations="int8")


@pytest.mark.usefixtures("torch_one_thread")
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3moe", "olmoe", "gptoss"])
def test_a_streams_int8_tokens_are_the_same_alone_beside_batch_mates_chunked_and_over_two_stages(zoo, family):
    model = zoo(family)
    one = _stages_int8(model.gguf_path)
    two = _stages_int8(model.gguf_path, (one[0].config.n_layers // 2,))
    vocab = one[0].config.vocab
    prompts = [prompt_ids(PROMPT_LEN - r, vocab, 40 + r) for r in range(5)]
    alone = greedy_generate(one, torch.tensor(prompts[0]), N_NEW)
    assert torch.equal(greedy_generate(two, torch.tensor(prompts[0]), N_NEW, prefill_chunk=5), alone)
    assert torch.equal(greedy_generate(one, torch.tensor(prompts[0]), N_NEW, prefill_chunk=3), alone)
    assert batched_greedy(one[0], prompts, N_NEW)[0] == alone.tolist()
    # near fp32's: the first step's logits of the same prompt, fp32 path against int8
    fp32 = _stages(model.gguf_path, ())[0]
    want = fp32.step(torch.tensor(prompts[0]), [(0, 0, len(prompts[0]), WANT_LAST | WANT_LOGITS)]).logits[0]
    one[0].reset()
    got = one[0].step(torch.tensor(prompts[0]), [(0, 0, len(prompts[0]), WANT_LAST | WANT_LOGITS)]).logits[0]
    assert not torch.equal(got, want)  # the int8 path ran
    # measured: llama 0.015, gemma3 0.16 (its 6 random layers grow the error ~3 % a layer: GeGLU's heavy-tailed
    # products set each block's scale); garbage would be ~1
    assert float((got - want).norm() / want.norm()) < 0.3


def test_the_engine_serves_int8_over_two_stage_processes_as_the_in_process_stage_computes(zoo):
    """... with the stages' row prefetch forced the other way from this process's one-row choice (for these 8-bit
    ops the other way from the CPU's choice on AMD Zen 4 and 5): speed only."""
    from ringshm.engine.engine import Engine
    from ringshm.model import qmatmul as qm

    model = zoo("qwen3")
    stages = _stages_int8(model.gguf_path)
    prompts = [prompt_ids(PROMPT_LEN, stages[0].config.vocab, 50 + i) for i in range(3)]
    want = []
    for p in prompts:
        stages[0].reset()
        want.append(greedy_generate(stages, torch.tensor(p), N_NEW).tolist())
    with Engine(model=str(model.gguf_path), stages=2, max_rows=4, max_seq_len=MAX_SEQ, prefill_chunk=8,
                progress=False, kv_cache_dtype="float32", matmul_activations="int8",
                row_prefetch=not qm.row_prefetch()) as engine:
        out = engine.generate_batch(prompts, max_new_tokens=N_NEW, ignore_eos=True)
        again = engine.generate(prompts[1], max_new_tokens=N_NEW, ignore_eos=True)  # a prefix-cache hit
    assert [r.token_ids for r in out.results] == want
    assert again.token_ids == want[1]
