"""Faults of the ring engine (issue 4): a stage SIGKILLed mid-decode is named within 2 s; nothing outlives
close(), a second close(), or an engine garbage-collected without close(); a checkpoint missing its layers is
refused before a stage starts; a stage whose loop breaks says why and exits non-zero (issue 27)."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

from conftest import own_segments
from ringshm.config import EngineConfig
from ringshm.engine.engine import Engine
from ringshm.errors import InvalidCheckpoint, StageDied
from ringshm.generation_params import GenerationParams
from ringshm.transport.segment import list_segments, process_start_time

KW = dict(prefill_chunk=64, max_rows=1, max_seq_len=256, progress=False)


def _gone(pids: list[int], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(process_start_time(p) is None for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_stage_killed_mid_decode_raises_stage_died_naming_it_within_2s(model_path):
    engine = Engine(model_path, stages=3, **KW)
    pids, names = engine.pids, engine.segment_names
    try:
        tokens = engine.stream("Tell me a long story about a lighthouse keeper.", max_new_tokens=200, chat=True)
        next(tokens)
        next(tokens)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(StageDied) as info:
            for _ in tokens:
                pass
        elapsed = time.monotonic() - t0
        assert info.value.stage == 1 and "stage 1" in str(info.value)
        assert elapsed < 2.0, f"StageDied after {elapsed:.2f} s"
    finally:
        engine.close()
        engine.close()  # idempotent
    assert _gone(pids)
    assert not set(names) & set(list_segments())


def test_engine_collected_without_close_leaves_no_process_and_no_segment(model_path):
    engine = Engine(model_path, stages=2, **KW)
    engine.generate("Hi", max_new_tokens=2)
    pids, names = engine.pids, engine.segment_names
    del engine
    gc.collect()
    assert _gone(pids)
    assert not set(names) & set(list_segments())


def test_a_config_object_in_place_of_the_model_path_is_refused_saying_how_to_pass_it():
    # once "File name too long" from the loader, which took str(config) for a path
    before = own_segments()
    with pytest.raises(TypeError, match=r"got EngineConfig.*Engine\(\*\*dataclasses.asdict\(config\)\)"):
        Engine(EngineConfig(stages=1))
    assert own_segments() <= before


@pytest.mark.parametrize("make, match", [
    (lambda: GenerationParams(max_tokens=5), r"unknown keyword argument 'max_tokens' \(did you mean 'max_new_tokens'"),
    (lambda: EngineConfig(stage=3), r"unknown keyword argument 'stage' \(did you mean 'stages'\?\).*EngineConfig"),
    (lambda: EngineConfig(bogus=1), r"unknown keyword argument 'bogus': the settings are EngineConfig's fields"),
])
def test_a_misspelt_setting_names_itself_and_the_closest_field(make, match):
    # once "GenerationParams.__init__() got an unexpected keyword argument", naming an internal class (a new user's
    # finding); Engine(stage=3) and engine.generate(..., max_tokens=5) pass their keywords to these
    with pytest.raises(TypeError, match=match):
        make()


def test_a_checkpoint_missing_its_layers_is_refused_before_any_stage_starts(tmp_path):
    # A tiny HF checkpoint whose config promises 2 layers but whose file holds only the embedding: once a stage
    # error at load (StageStartupError), now the coordinator's checkpoint check, before any process or segment.
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, '
        '"intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, '
        '"vocab_size": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256, '
        '"tie_word_embeddings": true}')
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(tmp_path / "model.safetensors"))
    before = own_segments()
    t0 = time.monotonic()
    with pytest.raises(InvalidCheckpoint, match="'num_hidden_layers' = 2 but the file holds tensors for no layer"):
        Engine(tmp_path, stages=2, **KW)
    assert time.monotonic() - t0 < 2.0
    assert own_segments() <= before


def test_a_stage_loop_error_outside_an_op_reaches_the_coordinator_with_its_cause_and_a_nonzero_exit(
        model_path, monkeypatch):
    """Stage 0's output ring is made smaller than the hidden states of one prefill op, so its reserve raises
    RecordTooLarge outside the op's try (as the reply ring did when it was sized from a vocab_size that lied).
    The stage used to exit 0 with nothing written: "stage 0 died: exit code 0", the cause lost."""
    from ringshm.runtime import launcher

    sized = launcher.ring_capacities
    monkeypatch.setattr(launcher, "ring_capacities", lambda *a: [c if i != 1 else 1 << 16 for i, c in
                                                                 enumerate(sized(*a))])
    before = own_segments()
    engine = Engine(model_path, stages=2, **KW)
    try:
        with pytest.raises(StageDied) as info:
            engine.generate(list(range(100, 160)), max_new_tokens=2)  # 60 x 576 fp32 = 135 KiB > 64 KiB
        msg = str(info.value)
        assert info.value.stage == 0 and info.value.exitcode == 1, msg
        assert "exit code 1: RecordTooLarge" in msg, msg
    finally:
        engine.close()
    assert own_segments() <= before
