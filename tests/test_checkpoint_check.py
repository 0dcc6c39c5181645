"""A model file is untrusted input (issue 27): every class of malformed checkpoint in ``checkpoint_corpus`` is
refused by the checkpoint check with its own one-line error, in bounded time and memory; random byte flips of a
small valid file give a clean error or a file that then loads and runs; the bounded GGUF walk agrees with
``gguf.GGUFReader`` on real files; the CLI refuses a bad file in one line before torch loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint_corpus import GGUF_CASES, HF_CASES, safetensors_bytes, tiny_gguf, tiny_weights, write_hf
from ringshm.errors import InvalidCheckpoint, UnsupportedArchitecture
from ringshm.model.checkpoint_check import check_checkpoint
from ringshm.model.gguf_index import GGUFIndex
from ringshm.model.stage_model import StageModel
from ringshm.transport.segment import list_segments

pytestmark = pytest.mark.usefixtures("torch_one_thread", "no_segment_left_behind")
CLEAN = (InvalidCheckpoint, UnsupportedArchitecture)  # what a model file may make the check raise
FAST_S = 1.0  # a refusal, measured around the check alone
PEAK_BYTES = 32 << 20  # Python-side allocations of one check (tracemalloc sees numpy's too)


def _refused(path: Path, case) -> tuple[BaseException, float, int]:
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(case.error) as info:
            check_checkpoint(path)
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return info.value, took, peak


@pytest.mark.parametrize("name", list(GGUF_CASES) + [f"hf:{n}" for n in HF_CASES])
def test_each_malformed_checkpoint_is_refused_naming_what_broke_in_one_line_fast_and_small(tmp_path, name):
    case = HF_CASES[name[3:]] if name.startswith("hf:") else GGUF_CASES[name]
    path = case.build(tmp_path)
    exc, took, peak = _refused(path, case)
    msg = str(exc)
    assert "\n" not in msg and msg.startswith(str(tmp_path)), msg
    assert all(w in msg for w in case.words), f"{name}: {msg}"
    assert took < FAST_S, f"{name}: refused after {took:.2f} s"
    assert peak < PEAK_BYTES, f"{name}: {peak / 2**20:.1f} MiB allocated"


def _run_tiny(path: Path) -> torch.Tensor:
    """Load every layer of a checked tiny checkpoint and run a 3-token prefill and one decode (the C layer)."""
    stage = StageModel.from_path(path, max_rows=1, max_seq_len=16)
    assert stage.native
    out = stage.forward(torch.tensor([1, 5, 9]), row=0, start=0, return_logits=True)
    stage.forward(out.token_ids[-1:], row=0, start=3)
    return out.logits


def test_the_corpus_base_files_pass_and_run(tmp_path):
    g = tiny_gguf().write(tmp_path / "tiny.gguf")
    h = write_hf(tmp_path / "hf")
    cg, ch = check_checkpoint(g).config, check_checkpoint(h).config
    assert replace(cg, rms_eps=ch.rms_eps) == ch and cg.rms_eps == pytest.approx(ch.rms_eps)  # one model, both ways
    assert torch.isfinite(_run_tiny(g)).all() and torch.isfinite(_run_tiny(h)).all()


# ------------------------------------------------------------------------------------------ byte flips
_BASE = tiny_gguf().encode()


def _data_start() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "t.gguf").write_bytes(_BASE)
        return GGUFIndex.open(Path(d) / "t.gguf").data_start


_DATA_START = _data_start()


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.one_of(st.integers(0, _DATA_START - 1), st.integers(0, len(_BASE) - 1)),
                                st.integers(1, 255)), min_size=1, max_size=6))
def test_random_byte_flips_of_a_gguf_give_a_clean_error_or_a_file_that_loads_and_runs(tmp_path, flips):
    data = bytearray(_BASE)
    for at, x in flips:
        data[at] ^= x
    path = tmp_path / "flipped.gguf"
    path.write_bytes(bytes(data))
    t0 = time.perf_counter()
    try:
        check_checkpoint(path)
    except CLEAN as exc:
        assert "\n" not in str(exc) and time.perf_counter() - t0 < FAST_S
        return
    _run_tiny(path)  # whatever it computes (NaN is fine), it must not crash: the kernels check lengths too


_HF_WEIGHTS = tiny_weights()
_HF_SHARD = safetensors_bytes(_HF_WEIGHTS)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["config", "shard_header"]), flips=st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4))
def test_random_byte_flips_of_an_hf_directory_give_a_clean_error_or_a_model_that_runs(tmp_path, where, flips):
    import json

    from checkpoint_corpus import tiny_hf_config

    config = bytearray(json.dumps(tiny_hf_config()).encode())
    shard = bytearray(_HF_SHARD)
    target, limit = (config, len(config)) if where == "config" else (shard, 8 + int.from_bytes(shard[:8], "little"))
    for at, x in flips:
        target[at % limit] ^= x
    d = tmp_path / "hf"
    shutil.rmtree(d, ignore_errors=True)
    write_hf(d, bytes(config), {"model.safetensors": bytes(shard)})
    try:
        check_checkpoint(d)
    except CLEAN as exc:
        assert "\n" not in str(exc)
        return
    _run_tiny(d)


# --------------------------------------------------------------------------- the walk against gguf's reader
def _reader_view(path: Path) -> tuple[dict, dict]:
    """(scalar metadata and array lengths, tensors) as gguf.GGUFReader reads them."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(str(path))
    meta = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = ("array", len(f.data)) if f.types[0] == GGUFValueType.ARRAY else f.contents()
    tensors = {t.name: (int(t.tensor_type), tuple(int(s) for s in t.shape), int(t.data_offset), int(t.n_bytes))
               for t in r.tensors}
    return meta, tensors


def _index_view(path: Path) -> tuple[dict, dict]:
    ix = GGUFIndex.open(path)
    meta = {k: v for k, v in ix.meta.items() if k not in ix.array_lengths}
    meta.update({k: ("array", n) for k, n in ix.array_lengths.items()})
    return meta, {n: (t.qtype, t.shape, t.offset, t.n_bytes) for n, t in ix.tensors.items()}


def test_the_bounded_walk_reads_what_gguf_reader_reads(tmp_path, model_path):
    for path in (tiny_gguf().write(tmp_path / "tiny.gguf"), model_path):
        ours, theirs = _index_view(path), _reader_view(path)
        assert ours[1] == theirs[1]
        assert ours[0].keys() == theirs[0].keys()
        for k, v in theirs[0].items():
            assert ours[0][k] == (pytest.approx(v) if isinstance(v, float) else v), k


# -------------------------------------------------------------------------------------------- the caches
def test_two_files_of_equal_name_size_and_times_get_their_own_tokenizer_cache_entries(tmp_path):
    """The key was name + size + mtime: B (another rms_eps, same size, mtime copied) read A's entry."""
    from checkpoint_corpus import KV, VT
    from ringshm.model.tokenizer import tokenizer_cache_key

    a, b = tiny_gguf(), tiny_gguf()
    b.kvs[[k.key for k in b.kvs].index("llama.attention.layer_norm_rms_epsilon")] = KV(
        "llama.attention.layer_norm_rms_epsilon", VT.FLOAT32, 1e-6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pa, pb = a.write(tmp_path / "a" / "model.gguf"), b.write(tmp_path / "b" / "model.gguf")
    assert pa.stat().st_size == pb.stat().st_size
    st_a = pa.stat()
    os.utime(pb, ns=(st_a.st_atime_ns, st_a.st_mtime_ns))
    assert tokenizer_cache_key(pa) != tokenizer_cache_key(pb)
    assert tokenizer_cache_key(pa) == tokenizer_cache_key(pa)  # and a key is stable


# --------------------------------------------------------------------------------------- the command line
CLI_CASES = ["vocab_1e6_real", "array_1e7_real", "string_100mb", "norm_short", "block_count_1e9",
             "hf:config_nested_1e5", "hf:tensor_in_two_shards"]


@pytest.mark.parametrize("name", CLI_CASES + ["serve:norm_1elem"])
def test_generate_and_serve_refuse_a_malformed_model_in_one_line_with_status_2_before_torch(tmp_path, name):
    command = ["serve", "--port", "1"] if name.startswith("serve:") else ["generate", "Hi"]  # (port 1: never bound)
    name = name.removeprefix("serve:")
    case = HF_CASES[name[3:]] if name.startswith("hf:") else GGUF_CASES[name]
    path = case.build(tmp_path)
    code = ("import sys, time; from ringshm.cli import main; t0 = time.perf_counter(); "
            f"rc = main({command + ['--model', str(path)]!r}); "
            "print(rc, 'torch' in sys.modules, round(time.perf_counter() - t0, 3))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=60)
    rc, torch_loaded, took = stdout.split()
    lines = stderr.strip().splitlines()
    assert (rc, torch_loaded) == ("2", "False"), (stdout, stderr)
    assert len(lines) == 1 and lines[0].startswith("ringshm: error: ") and "Traceback" not in stderr, stderr
    assert all(w in lines[0] for w in case.words), lines[0]
    assert float(took) < 2 * FAST_S, f"main() took {took} s"
    assert not [s for s in list_segments() if s.startswith(f"/ringshm-{proc.pid}-")]


@pytest.mark.parametrize("n_tokens, fits", [(100, True), (200, False)])
def test_an_hf_tokenizer_with_more_tokens_than_embedding_rows_is_refused_when_loaded(tmp_path, n_tokens, fits):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ringshm.model.tokenizer import load_tokenizer

    d = write_hf(tmp_path / "hf")  # vocab_size 128
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_tokens)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    if fits:
        assert len(load_tokenizer(d)) == n_tokens  # a padded vocabulary (fewer tokens than rows) is fine
    else:
        with pytest.raises(InvalidCheckpoint, match="holds 200 tokens but 'vocab_size' .* is 128"):
            load_tokenizer(d)


def test_nan_and_inf_in_weights_are_said_at_load_per_tensor(tmp_path, caplog):
    """A NaN in a norm and an Inf scale in one Q8_0 block load (the file is well-formed) but are named at load,
    instead of a model that serves garbage silently; a clean file says nothing."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    from ringshm.model.loader import Checkpoint

    clean = tiny_gguf().write(tmp_path / "clean.gguf")
    f = tiny_gguf()
    norm = f.tensor("blk.1.attn_norm.weight")
    values = np.frombuffer(norm.data, "<f4").copy()
    values[3] = np.nan
    norm.data = values.tobytes()
    up = f.tensor("blk.0.ffn_up.weight")
    blocks = quants.quantize(np.ones((128, 64), np.float32), QT.Q8_0).copy()
    blocks.reshape(-1, 34)[5, :2] = np.array([np.inf], np.float16).view(np.uint8)  # block 5's scale d
    up.qtype, up.data = QT.Q8_0, blocks.tobytes()
    broken = f.write(tmp_path / "broken.gguf")
    with caplog.at_level("WARNING", logger="ringshm.model.loader"):
        Checkpoint.open(clean).load_stage((0, 2), True, True)
        assert not [r for r in caplog.records if "NaN" in r.getMessage()]
        Checkpoint.open(broken).load_stage((0, 2), True, True)
    lines = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
    assert len(lines) == 1 and "blk.0.ffn_up.weight (1 blocks)" in lines[0], lines
    assert "blk.1.attn_norm.weight (1 values)" in lines[0], lines


def test_tokenizer_metadata_transformers_cannot_convert_is_one_line_after_the_stages_close(tmp_path):
    """The corpus GGUF's tokenizer section has no scores (transformers raised KeyError: 'scores', a traceback,
    once the stages were up): now one InvalidCheckpoint line, exit 2, every stage and segment gone."""
    from ringshm.model.tokenizer import load_tokenizer

    path = tiny_gguf().write(tmp_path / "tiny.gguf")
    with pytest.raises(InvalidCheckpoint, match="could not build a tokenizer .*KeyError: 'scores'"):
        load_tokenizer(path, cache_dir=tmp_path / "cache")
    proc = subprocess.Popen([sys.executable, "-m", "ringshm", "generate", "--model", str(path), "--stages", "1",
                             "--max-seq-len", "64", "--max-new-tokens", "4", "Hi"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HOME": str(tmp_path)})  # its own tokenizer cache
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.startswith("ringshm: error")]
    assert proc.returncode == 2 and "Traceback" not in err and len(lines) == 1, err
    assert "KeyError: 'scores'" in lines[0], lines
    assert not [s for s in list_segments() if s.startswith(f"/ringshm-{proc.pid}-")]


def test_the_native_gguf_types_are_the_ones_the_matmul_reads():
    from ringshm.model import qmatmul
    from ringshm.model.checkpoint_check import NATIVE_GGUF_TYPES, readable_gguf_type

    assert NATIVE_GGUF_TYPES == set(qmatmul.TYPE_NAMES.values()) and readable_gguf_type("MXFP4")


def test_an_mxfp4_ffn_is_read_in_its_encoding_and_runs_bitwise_as_its_f32_dequantization(tmp_path, caplog):
    """gpt-oss stores its experts as MXFP4 (ggml type 39). The loader keeps such weights in their encoding (no
    widening to fp32 at load), and as d = 2^(e - 128) is a power of two the matmul's d * (sum of x q) is the F32
    weight's sum of x (d q) step for step: the model's logits have the bits of the same file with those
    tensors stored as their exact F32 dequantization."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    mx, f32 = tiny_gguf(), tiny_gguf()
    for i in range(2):
        for part in ("ffn_gate", "ffn_up", "ffn_down"):
            a, b = mx.tensor(f"blk.{i}.{part}.weight"), f32.tensor(f"blk.{i}.{part}.weight")
            blocks = quants.quantize(np.frombuffer(a.data, "<f4").reshape(tuple(reversed(a.dims))), QT.MXFP4)
            a.qtype, a.data = QT.MXFP4, blocks.tobytes()
            b.data = quants.dequantize(blocks, QT.MXFP4).astype("<f4").tobytes()
    with caplog.at_level("WARNING", logger="ringshm.model.loader"):
        logits = _run_tiny(mx.write(tmp_path / "mxfp4.gguf"))
    assert not [r for r in caplog.records if "fp32 at load" in r.getMessage() or "NaN" in r.getMessage()]
    assert torch.equal(logits, _run_tiny(f32.write(tmp_path / "f32.gguf")))
