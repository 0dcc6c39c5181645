"""Two "hosts" on one machine (issue 13): the head is this test process (node 0), the worker its own process
tree (``python -m ringshm worker``, a new session) with its own segment tag; they meet on 127.0.0.1.

- Golden: 2 nodes x 2 stages equal the oracle (tie-aware) and, byte for byte, the same 4-stage split on one
  host, over greedy, seeded sampling, speculative and JSON-constrained streams at once. The worker starts before
  the head.
- Faults: SIGKILL of the worker mid-decode -> StageDied naming the remote stage within 5 s; SIGSTOP -> the same
  within the edge timeout; SIGKILL of the head -> the worker's stages exit and leave no segment; a wrong token
  or a model copy whose fingerprint differs is refused by name on both sides.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from engine_prompts import long_user_message
from ringshm.engine.engine import Engine
from ringshm.errors import ClusterRefused, StageDied
from ringshm.generation_params import StructuredOutput
from ringshm.transport.segment import list_segments, sweep_stale
from test_bridge import free_port

pytestmark = pytest.mark.usefixtures("no_segment_left_behind")
ENGINE = dict(max_rows=4, max_seq_len=1024, prefill_chunk=64, progress=False)
JSON = StructuredOutput("json_schema", {"type": "object", "properties": {"city": {"type": "string"}},
                                        "required": ["city"]})


def start_worker(port: int, *args: str, env: dict | None = None) -> subprocess.Popen:
    """``ringshm worker`` as node 1 of 2 in its own session (so a signal can reach its whole tree)."""
    return subprocess.Popen([sys.executable, "-m", "ringshm", "worker", "--nnodes", "2", "--node-rank", "1",
                             "--master-port", str(port), "--wait", "120", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def stop_tree(proc: subprocess.Popen) -> str:
    """Kill what is left of a process tree (its session), reap it, return its stderr."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    _, err = proc.communicate(timeout=30)
    return err


@contextmanager
def two_nodes(stages: int = 2, **options):
    port = free_port()
    worker = start_worker(port)
    try:
        with Engine(stages=stages, nnodes=2, master_port=port, **{**ENGINE, **options}) as engine:
            yield engine, worker
    finally:
        stop_tree(worker)
        sweep_stale()  # the worker's tree may have been SIGKILLed: its segments have no live creator


def _run(engine, tokenizer) -> dict:
    """Greedy and seeded-sampling batches (4 streams sharing step ops), a speculative stream and a long prompt
    alone: every token id. With the prefix cache on, every request after the first batch hits it."""
    long = tokenizer.apply_chat_template([{"role": "user", "content": long_user_message()}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False)
    prompts = ["The capital of France is", "Write a haiku about shared memory.", list(long),
               "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,"]
    return {
        "greedy": [r.token_ids for r in engine.generate_batch(prompts, 24).results],
        "sampled": [r.token_ids for r in engine.generate_batch(prompts, 24, temperature=0.8, seed=7).results],
        "spec": engine.generate(prompts[3], 24, spec="ngram").token_ids,
        # greedy under a JSON schema: each op's MASKS record crosses the edge behind it to the last stage
        "json": [r.token_ids for r in engine.generate_batch(prompts[:2], 24, structured_output=JSON).results],
        "alone": engine.generate(prompts[2], 24).token_ids,
    }


def test_two_nodes_with_cache_hits_equal_the_oracle_and_one_host_without_the_cache_byte_for_byte(
        model_path, tokenizer, prompts, oracle_greedy, assert_greedy_matches):
    port = free_port()
    worker = start_worker(port)  # before the head: it waits for it
    assert "waiting for the head" in worker.stderr.readline()
    time.sleep(1.0)
    try:
        with Engine(model_path, stages=4, nnodes=2, master_port=port, **ENGINE) as engine:
            assert engine.segment_names and all(".n0-" in n for n in engine.segment_names)
            assert list_segments("n1"), "the worker's rings carry its own tag"
            two = _run(engine, tokenizer)
            assert engine.kv.stats().hit_tokens > 500, "the repeated prompts hit the prefix cache across hosts"
            for i, prompt in enumerate(prompts[:2]):
                result = engine.generate(prompt.tolist(), max_new_tokens=12)
                assert_greedy_matches(torch.tensor(result.token_ids), oracle_greedy(prompt, 12), f"2 nodes, {i}")
        assert worker.wait(timeout=30) == 0  # the head's SHUTDOWN crossed: the worker ends cleanly
        assert "shut the engine down" in worker.stderr.read()
        assert not list_segments("n1")
    finally:
        stop_tree(worker)
    with Engine(model_path, stages=4, prefix_cache=False, **ENGINE) as engine:  # one host, every prompt computed
        one = _run(engine, tokenizer)
    assert two == one


def _kill_mid_decode(sig: int, edge_timeout_s: float) -> tuple[StageDied, float]:
    """Start a long decode on 1 + 1 stages, send ``sig`` to the worker's tree after a few tokens, return the
    error and the seconds from the signal to it."""
    with two_nodes(stages=2, edge_timeout_s=edge_timeout_s) as (engine, worker):
        t_sig = None
        with pytest.raises(StageDied) as info:
            for i, _ in enumerate(engine.stream("Count from one to a thousand:", max_new_tokens=800)):
                if i == 5:
                    os.killpg(worker.pid, sig)
                    t_sig = time.monotonic()
        return info.value, time.monotonic() - t_sig


def test_sigkill_of_the_worker_mid_decode_raises_stage_died_naming_the_remote_stage_within_5_s():
    exc, elapsed = _kill_mid_decode(signal.SIGKILL, edge_timeout_s=5.0)
    assert elapsed < 5.0, f"took {elapsed:.1f} s"
    assert exc.stage == 1 and "stage 1 on node 1 (127.0.0.1)" in str(exc), str(exc)


def test_sigstop_of_the_worker_raises_stage_died_within_the_edge_timeout():
    exc, elapsed = _kill_mid_decode(signal.SIGSTOP, edge_timeout_s=2.0)
    assert elapsed < 2.0 + 1.5, f"took {elapsed:.1f} s"
    assert exc.stage == 1 and "node 1" in str(exc) and "nothing heard for 2 s" in str(exc), str(exc)


def test_killing_the_head_stops_the_workers_stages_and_leaves_no_segment():
    port = free_port()
    head = subprocess.Popen([sys.executable, str(Path(__file__).with_name("_multihost_head.py")), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    worker = start_worker(port)
    try:
        assert head.stdout.readline().strip() == "ready"
        children = psutil.Process(worker.pid).children(recursive=True)
        assert len(children) >= 3  # its stage and its two bridges
        assert list_segments("n1")
        time.sleep(1.0)  # mid-decode
        os.killpg(head.pid, signal.SIGKILL)
        assert worker.wait(timeout=20) == 1
        assert "stopping:" in worker.stderr.read()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"the worker left {alive}"
        assert not list_segments("n1")
    finally:
        stop_tree(worker)
        stop_tree(head)
        sweep_stale()  # the SIGKILLed head's own segments


def test_a_worker_with_another_token_is_refused_by_name_on_both_sides():
    port = free_port()
    worker = start_worker(port, env={"RINGSHM_TOKEN": "worker-secret"})
    try:
        with pytest.raises(ClusterRefused, match="did not join .* token does not match"):
            Engine(stages=2, nnodes=2, master_port=port, token="head-secret", startup_timeout_s=8, **ENGINE)
        assert worker.wait(timeout=30) == 1
        assert "token" in worker.stderr.read()
    finally:
        stop_tree(worker)


def test_a_worker_with_a_wrong_token_does_not_lock_the_right_one_out():
    """The rank was claimed in the store before the token was checked and never given back: the worker with the
    right token was refused ("another worker already joined") and the head gave up at its startup timeout."""
    port = free_port()
    made: list = []
    head = threading.Thread(target=lambda: made.append(_engine_or_error(
        stages=2, nnodes=2, master_port=port, token="right", startup_timeout_s=90, **ENGINE)))
    head.start()
    wrong = start_worker(port, env={"RINGSHM_TOKEN": "wrong"})
    right = None
    try:
        assert wrong.wait(timeout=60) == 1 and "token" in wrong.stderr.read()
        right = start_worker(port, env={"RINGSHM_TOKEN": "right"})
        head.join(timeout=120)
        engine = made[0]
        assert isinstance(engine, Engine), engine
        with engine:
            assert engine.generate("The capital of France is", max_new_tokens=4).n_output_tokens == 4
        assert right.wait(timeout=30) == 0
    finally:
        stop_tree(wrong)
        if right is not None:
            stop_tree(right)
        head.join(timeout=5)
        sweep_stale()


def _engine_or_error(**kw):
    try:
        return Engine(**kw)
    except Exception as exc:  # noqa: BLE001 - handed to the test thread
        return exc


def test_kill_9_of_the_worker_process_ends_its_stages_and_bridges_and_the_head_learns_it():
    """Only the ``ringshm worker`` process is killed (not its tree): its stage and bridges used to live on, and
    the head kept serving through them."""
    with two_nodes(stages=2) as (engine, worker):
        children = psutil.Process(worker.pid).children(recursive=True)
        assert len(children) >= 3  # its stage and its two bridges
        assert engine.generate("The capital of France is", max_new_tokens=4).n_output_tokens == 4
        os.kill(worker.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"the killed worker left {alive}"
        deadline = time.monotonic() + 10
        with pytest.raises(StageDied, match="node 1"):
            while time.monotonic() < deadline:
                engine.generate("The capital of France is", max_new_tokens=4)


def test_a_worker_whose_model_copy_differs_is_refused_by_name_on_both_sides(model_path, tmp_path):
    copy = tmp_path / "other.gguf"
    shutil.copyfile(model_path, copy)
    size = copy.stat().st_size
    with open(copy, "r+b") as f:  # one byte inside a fingerprinted block of the weights
        f.seek(10 * size // 64)
        b = f.read(1)
        f.seek(10 * size // 64)
        f.write(bytes([b[0] ^ 1]))
    port = free_port()
    worker = start_worker(port, "--model", str(copy))
    try:
        with pytest.raises(ClusterRefused, match="node 1 .*refused to join: model fingerprint"):
            Engine(stages=2, nnodes=2, master_port=port, **ENGINE)
        assert worker.wait(timeout=30) == 1
        assert "model fingerprint" in worker.stderr.read()
    finally:
        stop_tree(worker)


def test_ringshm_serve_and_ringshm_worker_as_the_readme_shows(tmp_path):
    from test_server import Server, _http

    port = free_port()
    worker = start_worker(port)
    server = Server(["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port),
                     "--stages", "2", "--max-seq-len", "512", "--max-rows", "2"], tmp_path / "serve.log")
    try:
        server.wait_healthy()
        stages = json.loads(_http(f"{server.url}/health")[1])["stages"]
        assert [(s["stage"], s["node"], s["seen"], s["alive"]) for s in stages] == [
            (0, 0, "process", True), (1, 1, "edges", True)], stages  # the worker's stage, seen through the edges
        assert stages[0]["pid"] > 0 and stages[1]["pid"] is None
        r = server.client().completions.create(model=server.client().models.list().data[0].id,
                                               prompt="The capital of France is", max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8
        with Engine(stages=2, max_seq_len=512, max_rows=2, progress=False) as engine:
            assert r.choices[0].text == engine.generate("The capital of France is", max_new_tokens=8).text
        assert server.stop() == 0
        assert worker.wait(timeout=30) == 0
    finally:
        server.stop()
        stop_tree(worker)
