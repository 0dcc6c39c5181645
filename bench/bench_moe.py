"""Mixture-of-experts models at the sizes people run (issue 29), figures only: ringshm at 1 and 2 stages against
llama.cpp (2 threads) on the same Q4_K_M (gpt-oss: MXFP4_MOE) files.

Models (random weights, Q4_K_M, built once under ``~/.cache/ringshm-bench/``, SmolLM2's tokenizer and 49,152-token
vocabulary in place of the models' own 151,936 / 50,304: the embedding is looked up, and only the LM head's size
changes the decode cost):

    olmoe-7b        OLMoE-1B-7B's body: 16 layers, hidden 2048, 16 MHA heads of 128, 64 experts of 1024, top 8,
                    not renormalised, q / k norms over the whole projection (~4 GB)
    qwen3moe-30b    Qwen3-30B-A3B's body: 48 layers, hidden 2048, 32 / 4 heads of 128, 128 experts of 768, top 8,
                    renormalised (~17 GB); only with ``RINGSHM_BENCH_30B=1`` (it needs the disk, ~10 min to write,
                    and most of a 23 GiB machine's memory)
    gptoss-20b      gpt-oss-20b's body: 24 layers, hidden 2880, 64 / 8 heads of 64 (sinks; every other layer a
                    128-key window), 32 experts of 2880, top 4, biased router and experts, the clamped SwiGLU, as
                    llama.cpp's MXFP4_MOE files: experts MXFP4, every other matrix Q8_0 (~11 GB; ggml-org's 12.1 GB
                    gpt-oss-20b-mxfp4.gguf leaves about a byte a weight outside the experts); only with
                    ``RINGSHM_BENCH_GPTOSS=1``

Tensor types are llama-quantize's Q4_K_M (``tests/zoo_quant.tensor_type``: experts Q4_K, ``ffn_down_exps`` and
``attn_v`` Q6_K on its more-bits layers, the head Q6_K, the router F32; gpt-oss as above), blocks drawn from a pool
of valid random blocks; the router weights are random too, so tokens spread over the experts about evenly.

Per model, one after another (never both resident: a 17 GB model cannot be held twice):
- ringshm at 1 stage, then 2 stages, then 1 stage with 8-bit activations (``matmul_activations="int8"``, the
  opt-in): load (``Engine(...)`` to ready), each stage's anonymous RSS (its private
  copy of the packed weights; the file's page cache is shared and reclaimable) and PSS, decode tok/s of one stream
  (32 tokens after 16), aggregate decode tok/s of 8 streams at once (the sum of each stream's 1 / TPOT), the two
  interleaved over ``ROUNDS`` rounds (medians), TTFT of a 512-token prompt (one step op; median of ``ROUNDS``:
  one sample of the OLMoE shape's moved 3.39-3.88 s within a minute on an AMD EPYC Zen 5);
- llama.cpp (2 threads, its own process): load, RSS growth, decode tok/s and TTFT 512 (medians of ``ROUNDS``).
The physical bound of decode is the bandwidth (``qmatmul.read_probe``, 2 threads, 1 GiB) over the bytes one token
reads: every non-expert weight plus k / E of the experts' (and the embedding row).

    RINGSHM_BENCH_30B=1 RINGSHM_BENCH_GPTOSS=1 python -m pytest bench/bench_moe.py --benchmark-only -s \
        -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench_peers import LlamaPeer  # skips this module where llama.cpp is not installed
from bench_sizes import CACHE, POOL_BLOCKS, _tokenizer_fields
from conftest import cpu_info, cpu_label

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # after bench/: its conftest first
from zoo_quant import make_weight, tensor_type  # noqa: E402  (the tests' llama-quantize type rules)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
N_NEW, N_PROMPT, N_LONG, N_STREAMS = 32, 16, 512, 8
ROUNDS = 3  # decode (1 and 8 streams) and TTFT measured this many times, medians: one sample moved by ±15 % here
SHAPES = {  # name: (arch, layers, hidden, heads, kv heads, head dim, experts, used, expert width)
    "olmoe-7b": ("olmoe", 16, 2048, 16, 16, 128, 64, 8, 1024),
    "qwen3moe-30b": ("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768),
    "gptoss-20b": ("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880),
}
OPT_IN = {"qwen3moe-30b": "RINGSHM_BENCH_30B", "gptoss-20b": "RINGSHM_BENCH_GPTOSS"}  # big files: asked for by name


def build(name: str, tokenizer_src: Path) -> Path:
    """Write (once) a random-weight MoE of ``SHAPES[name]`` as a Q4_K_M (gpt-oss: MXFP4_MOE) GGUF, streaming one
    tensor at a time (the writer holds only the tensor table: a 17 GB file is never in memory)."""
    import gguf

    arch, n_layers, hidden, heads, kv_heads, head_dim, n_exp, used, width = SHAPES[name]
    oss = arch == "gpt-oss"
    path = CACHE / f"{name}-{'mxfp4_moe' if oss else 'q4_k_m'}.gguf"
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    vocab = len(gguf.GGUFReader(str(tokenizer_src)).fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    pools: dict = {}

    def tensors():
        """(name, role, layer, shape in torch order) in file order; role None: an F32 vector of ones, "bias": small
        random F32 values, "sinks": F32 of about unit size."""
        yield "token_embd.weight", "token_embd", None, (vocab, hidden)
        for i in range(n_layers):
            q, kv = heads * head_dim, kv_heads * head_dim
            yield f"blk.{i}.attn_norm.weight", None, i, (hidden,)
            for role, rows, cols in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                     ("attn_output", hidden, q)):
                yield f"blk.{i}.{role}.weight", role, i, (rows, cols)
                if oss:
                    yield f"blk.{i}.{role}.bias", "bias", i, (rows,)
            if oss:
                yield f"blk.{i}.attn_sinks.weight", "sinks", i, (heads,)
                yield f"blk.{i}.post_attention_norm.weight", None, i, (hidden,)
            else:
                yield f"blk.{i}.attn_q_norm.weight", None, i, (q if arch == "olmoe" else head_dim,)
                yield f"blk.{i}.attn_k_norm.weight", None, i, (kv if arch == "olmoe" else head_dim,)
                yield f"blk.{i}.ffn_norm.weight", None, i, (hidden,)
            yield f"blk.{i}.ffn_gate_inp.weight", "ffn_gate_inp", i, (n_exp, hidden)
            yield f"blk.{i}.ffn_gate_exps.weight", "ffn_gate_exps", i, (n_exp, width, hidden)
            yield f"blk.{i}.ffn_up_exps.weight", "ffn_up_exps", i, (n_exp, width, hidden)
            yield f"blk.{i}.ffn_down_exps.weight", "ffn_down_exps", i, (n_exp, hidden, width)
            if oss:
                yield f"blk.{i}.ffn_gate_inp.bias", "bias", i, (n_exp,)
                for role, rows in (("ffn_gate_exps", width), ("ffn_up_exps", width), ("ffn_down_exps", hidden)):
                    yield f"blk.{i}.{role}.bias", "bias", i, (n_exp, rows)
        yield "output_norm.weight", None, None, (hidden,)
        yield "output.weight", "output", None, (vocab, hidden)

    def qtype_of(role, layer, shape):
        if role in (None, "bias", "sinks"):
            return gguf.GGMLQuantizationType.F32
        if oss:  # llama.cpp's MXFP4_MOE: the released gpt-oss files' experts, Q8_0 elsewhere (the router F32)
            return gguf.GGMLQuantizationType.MXFP4 if role.endswith("_exps") else gguf.GGMLQuantizationType.F32 \
                if role == "ffn_gate_inp" else gguf.GGMLQuantizationType.Q8_0
        return tensor_type("q4_k_m", role, layer, n_layers, shape[-1], len(shape), False)

    def data(role, layer, shape):
        if role is None:
            return np.ones(shape, dtype=np.float32), gguf.GGMLQuantizationType.F32
        if role in ("bias", "sinks"):
            return rng.normal(0, 0.02 if role == "bias" else 1.0, size=shape).astype(np.float32), \
                gguf.GGMLQuantizationType.F32
        qtype = qtype_of(role, layer, shape)
        if qtype == gguf.GGMLQuantizationType.F32:  # the router: std 1 / sqrt(hidden), logits of about unit size
            return rng.normal(0, hidden ** -0.5, size=shape).astype(np.float32), qtype
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if qtype not in pools:
            raw, _ = make_weight(qtype, (POOL_BLOCKS // 16, 16 * block), 0.02, rng)
            pools[qtype] = raw.reshape(POOL_BLOCKS, block_bytes)
        rows = int(np.prod(shape[:-1]))
        pick = rng.integers(0, POOL_BLOCKS, size=rows * shape[-1] // block)
        return pools[qtype][pick].reshape(*shape[:-1], shape[-1] // block * block_bytes), qtype

    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"ringshm-bench-{name}")
    w.add_block_count(n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(width)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base({"qwen3moe": 1e6, "gpt-oss": 150000.0}.get(arch, 10000.0))
    w.add_layer_norm_rms_eps(1e-6 if arch == "qwen3moe" else 1e-5)
    if oss:  # GptOssModel's keys: YaRN x 32 over 4096, a 128-key window
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(32.0)
        w.add_rope_scaling_orig_ctx_len(4096)
        w.add_sliding_window(128)
    if arch in ("qwen3moe", "gpt-oss"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_feed_forward_length(width)
    w.add_expert_count(n_exp)
    w.add_expert_used_count(used)
    mxfp4_moe = getattr(gguf.LlamaFileType, "MOSTLY_MXFP4_MOE", 38)  # (gguf-py 0.18 lacks the name)
    w.add_file_type(mxfp4_moe if oss else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, val, vtype, sub in _tokenizer_fields(tokenizer_src):
        w.add_key_value(key, val, vtype, sub)
    plan = list(tensors())
    for tname, role, layer, shape in plan:  # the table first (shapes and types), then the data in the same order
        qtype = qtype_of(role, layer, shape)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(np.prod(shape[:-1])) * shape[-1] // block * block_bytes
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor_info(tname, shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
        else:  # uint8 bytes: the writer takes the byte shape
            w.add_tensor_info(tname, (*shape[:-1], shape[-1] // block * block_bytes), np.dtype(np.uint8), n_bytes,
                              raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, role, layer, shape in plan:
        w.write_tensor_data(data(role, layer, shape)[0])
    w.close()
    tmp.rename(path)
    return path


def active_bytes(path: Path) -> float:
    """Bytes one decoded token reads: every tensor but the experts and the embedding, k / E of the experts, one
    embedding row (the GGUF's own sizes)."""
    from ringshm.model.gguf_index import GGUFIndex

    index = GGUFIndex.open(path)
    arch = index.meta["general.architecture"]
    frac = index.meta[f"{arch}.expert_used_count"] / index.meta[f"{arch}.expert_count"]
    total = 0.0
    for name, t in index.tensors.items():
        if "_exps." in name:
            total += t.n_bytes * frac
        elif name == "token_embd.weight":
            total += t.n_bytes / t.shape[1]
        else:
            total += t.n_bytes
    return total


def _anon_mb(pid: int) -> tuple[float, float]:
    """(anonymous RSS, PSS) of a process in MB (/proc: RssAnon, smaps_rollup Pss)."""
    def field(path: str, key: str) -> float:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / 1e6
        return float("nan")

    return field(f"/proc/{pid}/status", "RssAnon"), field(f"/proc/{pid}/smaps_rollup", "Pss")


def measure_ringshm(path: Path, stages: int, activations: str = "float32") -> dict:
    from ringshm.engine.engine import Engine

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(100, 40000, N_PROMPT)]
    prompts = [[int(t) for t in rng.integers(100, 40000, N_PROMPT)] for _ in range(N_STREAMS)]
    long = [int(t) for t in rng.integers(100, 40000, N_LONG)]
    t0 = time.perf_counter()
    with Engine(model=str(path), stages=stages, max_rows=N_STREAMS, max_seq_len=1024, prefill_chunk=N_LONG,
                progress=False, prefix_cache=False, matmul_activations=activations) as engine:
        out = {"load_s": time.perf_counter() - t0, "stage_anon_pss_mb": [_anon_mb(p) for p in engine.pids]}
        engine.generate(prompt, max_new_tokens=4, stop=None, ignore_eos=True)  # warm: first-touch of the scratch
        one, eight = [], []
        for _ in range(ROUNDS):  # interleaved, so that 8 streams / 1 compares the same minutes of this VM
            one.append(1 / engine.generate(prompt, max_new_tokens=N_NEW, stop=None, ignore_eos=True).tpot_s)
            batch = engine.generate_batch(prompts, max_new_tokens=N_NEW, stop=None, ignore_eos=True)
            eight.append(sum(1 / x.tpot_s for x in batch.results))
        out["decode_tok_s"], out["aggregate_tok_s"] = statistics.median(one), statistics.median(eight)
        ttft = [engine.generate(long, max_new_tokens=1, stop=None).ttft_s for _ in range(ROUNDS)]
        out["ttft_512_s"], out["ttft_512_rounds_s"] = statistics.median(ttft), ttft
        out["stage_anon_pss_mb_after"] = [_anon_mb(p) for p in engine.pids]
    return out


def measure_llama(path: Path) -> dict:
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(100, 40000, N_PROMPT)]
    long = [int(t) for t in rng.integers(100, 40000, N_LONG)]
    t0 = time.perf_counter()
    peer = LlamaPeer(str(path), 2)
    out = {"load_s": time.perf_counter() - t0}
    try:
        peer.call("decode", prompt, 4)
        out["decode_tok_s"] = statistics.median(1 / peer.call("decode", prompt, N_NEW)["tpot_s"]
                                                for _ in range(ROUNDS))
        ttft = [peer.call("prefill", long)["ttft_s"] for _ in range(ROUNDS)]
        out["ttft_512_s"], out["ttft_512_rounds_s"] = statistics.median(ttft), ttft
        out["rss_mb"] = (peer.call("rss")["rss"] - peer.info["rss_base"]) / 1e6
    finally:
        peer.close()
    return out


def test_moe_ringshm_vs_llama_cpp(benchmark, figures):
    import torch

    from ringshm.model import qmatmul as qm
    from ringshm.model.packaged import default_model_path

    names = ["olmoe-7b"] + [n for n, var in OPT_IN.items() if os.environ.get(var) == "1"]
    found = {n: build(n, default_model_path()) for n in names}
    buf = torch.ones(1 << 28, dtype=torch.float32)
    qm.read_probe(buf, 2)
    t0 = time.perf_counter()
    n_read = qm.read_probe(buf, 2)
    bandwidth = n_read / (time.perf_counter() - t0)
    del buf
    table: dict = {}

    def run():
        for name, path in found.items():
            table[name] = {"ringshm_1": measure_ringshm(path, 1), "ringshm_2": measure_ringshm(path, 2),
                           "ringshm_1_int8": measure_ringshm(path, 1, "int8"),
                           "llama": measure_llama(path), "active_gb": active_bytes(path) / 1e9,
                           "file_gb": path.stat().st_size / 1e9}

    benchmark.pedantic(run, rounds=1, iterations=1)
    lines = [f"mixture-of-experts models (bench_moe.py), CPU: {cpu_label()}; bandwidth {bandwidth / 1e9:.1f} GB/s "
             f"(read_probe, 2 threads)",
             f"{'model':>13} {'engine':>10} | {'load s':>6} | {'anon RSS / PSS MB per stage':>28} | "
             f"{'decode tok/s':>12} {'8 streams':>9} | {'TTFT 512 s':>10}"]
    for name, t in table.items():
        bound = bandwidth / (t["active_gb"] * 1e9)
        for key, label in (("ringshm_1", "ringshm 1"), ("ringshm_2", "ringshm 2"), ("ringshm_1_int8", "1, int8")):
            r = t[key]
            mem = ", ".join(f"{a:.0f} / {p:.0f}" for a, p in r["stage_anon_pss_mb_after"])
            lines.append(f"{name:>13} {label:>10} | {r['load_s']:6.1f} | {mem:>28} | {r['decode_tok_s']:12.2f} "
                         f"{r['aggregate_tok_s']:9.2f} | {r['ttft_512_s']:10.2f}")
        ll = t["llama"]
        lines.append(f"{name:>13} {'llama.cpp':>10} | {ll['load_s']:6.1f} | {ll['rss_mb']:>21.0f} (RSS) | "
                     f"{ll['decode_tok_s']:12.2f} {'':>9} | {ll['ttft_512_s']:10.2f}")
        r1 = t["ringshm_1"]
        lines.append(f"{'':>13} file {t['file_gb']:.1f} GB, {t['active_gb']:.2f} GB read per token: bound "
                     f"{bound:.2f} tok/s; decode ringshm / llama.cpp {r1['decode_tok_s'] / ll['decode_tok_s']:.2f}, "
                     f"8 streams / 1 {r1['aggregate_tok_s'] / r1['decode_tok_s']:.2f}, TTFT ringshm / llama.cpp "
                     f"{r1['ttft_512_s'] / ll['ttft_512_s']:.2f}; of the bound: ringshm "
                     f"{r1['decode_tok_s'] / bound:.2f}, llama.cpp {ll['decode_tok_s'] / bound:.2f}")
        q8 = t["ringshm_1_int8"]
        lines.append(f"{'':>13} int8 activations (opt-in), 1 stage: decode / llama.cpp "
                     f"{q8['decode_tok_s'] / ll['decode_tok_s']:.2f}, 8 streams / its 1 "
                     f"{q8['aggregate_tok_s'] / q8['decode_tok_s']:.2f}, 8 streams / fp32's 1 "
                     f"{q8['aggregate_tok_s'] / r1['decode_tok_s']:.2f}, TTFT / llama.cpp "
                     f"{q8['ttft_512_s'] / ll['ttft_512_s']:.2f}")
        figures.record_value(f"moe.{name}.decode.ringshm", 1 / r1["decode_tok_s"])
        figures.record_value(f"moe.{name}.decode.llama", 1 / ll["decode_tok_s"])
        figures.ratio(f"{name}: decode tok/s ringshm / llama.cpp", f"moe.{name}.decode.llama",
                      f"moe.{name}.decode.ringshm")
    figures.summary.extend(lines)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "moe.json").write_text(json.dumps({"cpu": cpu_info(), "bandwidth": bandwidth, "table": table},
                                                     indent=1))
