"""A start that fails fast (issue 20): a mistake the user can fix is named in one line, exit status 2, in under
two seconds, before torch is imported and before any stage loads; and a stop signal while the stages load stops
them at once, saying so."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from ringshm.transport.segment import list_segments, process_start_time

pytestmark = pytest.mark.usefixtures("no_segment_left_behind")
FAST_S = 2.0


def _ringshm(*args: str, timeout_s: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "ringshm", *args], capture_output=True, text=True, timeout=timeout_s)
    return out, time.monotonic() - t0


def _assert_refused(out: subprocess.CompletedProcess, took_s: float, *words: str) -> None:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out
    assert len(lines) == 1 and lines[0].startswith("ringshm: error: ") and "Traceback" not in out.stderr, out.stderr
    assert all(w in lines[0] for w in words), lines[0]
    assert took_s < FAST_S, f"took {took_s:.1f} s"


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_serve_on_a_port_in_use_exits_2_at_once_naming_it(busy_port):
    out, took_s = _ringshm("serve", "--port", str(busy_port))
    _assert_refused(out, took_s, f"--port {busy_port}", "already in use")


@pytest.mark.parametrize("port", ["99999", "0", "-1"])
def test_serve_on_a_port_out_of_range_exits_2_at_once(port):
    out, took_s = _ringshm("serve", "--port", port)
    _assert_refused(out, took_s, "--port", "outside 1-65535")


@pytest.mark.parametrize("args, words", [
    (["generate", "--stages", "0", "Hi"], ["stages must be", "(the flag --stages)"]),
    (["generate", "--prefill-chunk", "0", "Hi"], ["prefill_chunk", "(the flag --prefill-chunk)"]),
    (["generate", "--max-new-tokens", "4096", "Hi"], ["--max-new-tokens"]),
    (["serve", "--stages", "0"], ["stages"]),
    (["serve", "--max-queue-wait", "0"], ["--max-queue-wait"]),
    (["serve", "--spec", "ngram", "--spec-k", "99"], ["spec_k"]),
    (["generate", "--seed", str(2**64), "Hi"], ["seed"]),  # torch's generator takes at most 2**64 - 1
    (["generate", "--stop", "x" * 257, "Hi"], ["stop[0]", "256"]),
    (["serve", "--served-model-name", ""], ["--served-model-name"]),
    (["serve", "--header-timeout", "0"], ["--header-timeout"]),
    (["serve", "--body-timeout", "-1"], ["--body-timeout"]),
    (["serve", "--prefill-stall-ratio", "1"], ["prefill_stall_ratio", "> 1", "(the flag --prefill-stall-ratio)"]),
    (["generate", "--temperature", "abc", "Hi"], ["ringshm generate", "--temperature", "'abc'", "--help"]),
    (["generate", "--no-such-option", "Hi"], ["generate: unrecognized", "--no-such-option", "ringshm generate --help"]),
    (["serve", "--port"], ["--port", "expected one argument"]),
    (["no-such-command"], ["invalid choice", "'no-such-command'"]),
])
def test_an_argument_error_exits_2_before_torch_loads(args, words):
    out, took_s = _ringshm(*args)
    _assert_refused(out, took_s, *words)


def test_a_model_path_that_does_not_exist_exits_2_at_once_saying_so():
    out, took_s = _ringshm("generate", "--model", "/no/such/dir/model.gguf", "Hi")
    _assert_refused(out, took_s, "/no/such/dir/model.gguf", "does not exist")
    code = ("import sys; from ringshm.cli import main; rc = main(['generate', '--model', '/no/such.gguf', 'Hi']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["2", "False"], out


def test_chat_with_a_model_that_has_no_chat_template_is_refused_before_the_stages_load():
    """Gemma 3 270M's (pretrained) file carries no template: transformers' raw error came after the stages loaded."""
    from ringshm.model.packaged import gemma3_270m_path

    gemma = gemma3_270m_path()
    out, took_s = _ringshm("generate", "--model", str(gemma), "--chat", "Hi")
    _assert_refused(out, took_s, str(gemma), "no chat template", "without --chat")


def test_the_argument_checks_do_not_import_torch():
    code = ("import sys; from ringshm.cli import main; rc = main(['generate', '--stages', '0', 'Hi']); "
            "assert rc == 2 and 'torch' not in sys.modules, (rc, 'torch' in sys.modules); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ok", out


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background shell job would start with SIGINT ignored


def stage_pids(parent: int) -> list[int]:
    """The stage processes under ``parent`` (children of its fork server, ringshm.runtime.launcher)."""
    try:
        below = psutil.Process(parent).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for c in below:
        try:
            if open(f"/proc/{c.pid}/cmdline", "rb").read().startswith(b"ringshm stage"):
                pids.append(c.pid)
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("command, sig, code", [
    (["generate", "Hi"], signal.SIGINT, 128 + signal.SIGINT),
    (["serve"], signal.SIGTERM, 0),  # serve's clean exit
])
def test_a_stop_signal_while_the_stages_load_stops_them_at_once_and_says_so(command, sig, code):
    if command == ["serve"]:
        command = ["serve", "--port", str(_free_port())]
    proc = subprocess.Popen([sys.executable, "-m", "ringshm", *command, "--stages", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_sigint_as_in_a_terminal, env=dict(os.environ))
    stopped: dict[int, object] = {}  # pid: start time
    try:
        _stop_while_loading(proc, sig, code, stopped)
    finally:  # a failed check must not leave frozen stages behind (the same processes only: start times)
        for pid, started in stopped.items():
            if started is not None and process_start_time(pid) == started:
                os.kill(pid, signal.SIGKILL)


def _stop_while_loading(proc, sig, code, stopped) -> None:
    try:
        deadline = time.monotonic() + 60
        while len(stopped) < 3:  # spawned: they are loading now
            for pid in set(stage_pids(proc.pid)) - set(stopped):
                # Frozen mid-load, so the signal is sure to come while they load: a warm fork server hands
                # them torch ready-made, and the 135M loads in ~0.2 s (a stage that finished first made this
                # test fail one run in four). Only SIGKILL, which a stopped process still takes, ends them.
                os.kill(pid, signal.SIGSTOP)
                stopped[pid] = process_start_time(pid)
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()  # stderr's end of file comes only once the process is gone
                pytest.fail(f"3 stages did not appear: {proc.communicate()[1].decode()}")
            time.sleep(0.002)
        stages = sorted(stopped)
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        took_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.decode()
    assert proc.returncode == code, text
    assert "while the stages loaded" in text and "Traceback" not in text, text
    assert took_s < 3.0, f"took {took_s:.1f} s to stop"
    assert all(process_start_time(p) is None for p in stages)
    assert [s for s in list_segments() if s.startswith(f"/ringshm-{proc.pid}-")] == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
