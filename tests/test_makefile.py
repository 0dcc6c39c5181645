"""`make install` on any Linux Python (issue 12): outside an environment it makes and uses .venv (a PEP 668
Python refuses `pip install` there), inside one it uses it, and without the venv module it stops with the fix.
`make -n -B` prints what would run without running it; nothing here installs anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_PYTHON = str(Path(sys.base_prefix) / "bin" / "python3")


def _make(*args: str, **env_over: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "PYTHON")}
    env.update(env_over)
    return subprocess.run(["make", "-C", str(ROOT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_outside_any_environment_make_install_creates_and_uses_dot_venv():
    out = _make("-n", "-B", "install", f"SYSTEM_PYTHON={BASE_PYTHON}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"{BASE_PYTHON} -m venv .venv" in lines
    pip_lines = [ln for ln in lines if "-m pip install" in ln]
    assert pip_lines and all(".venv/bin/python -m pip install" in ln for ln in pip_lines), pip_lines
    assert not any(ln.startswith(f"{BASE_PYTHON} -m pip") for ln in lines)


def test_inside_an_active_environment_make_install_uses_it(tmp_path):
    env = tmp_path / "env"
    subprocess.run([BASE_PYTHON, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    py = str(env / "bin" / "python")
    out = _make("-n", "-B", "install", f"SYSTEM_PYTHON={py}", VIRTUAL_ENV=str(env))
    assert out.returncode == 0, out.stderr
    assert "-m venv" not in out.stdout
    assert f"{py} -m pip install --no-build-isolation -e \".[test]\"" in out.stdout


def test_without_the_venv_module_make_stops_with_the_one_line_fix(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\ncase \"$*\" in *'import venv'*) exit 1;; esac\nexec {BASE_PYTHON} \"$@\"\n")
    fake.chmod(0o755)
    out = _make("install", f"SYSTEM_PYTHON={fake}", f"VENV={tmp_path / 'venv'}")
    assert out.returncode != 0
    assert "apt install python3-venv" in out.stderr
    assert not (tmp_path / "venv").exists()


def test_dot_venv_is_git_ignored_and_clean_keeps_it():
    assert ".venv/" in (ROOT / ".gitignore").read_text().split()
    out = _make("-n", "clean")
    assert ".venv" not in out.stdout
    assert "rm -rf .venv" in _make("-n", "distclean").stdout


def _torch_line(out: subprocess.CompletedProcess) -> str:
    return next(ln for ln in out.stdout.splitlines() if 'pip install' in ln and '"torch==' in ln)


def test_without_a_gpu_torch_is_the_cpu_only_wheel_from_pytorchs_cpu_index(tmp_path):
    out = _make("-n", "-B", "install", f"SYSTEM_PYTHON={BASE_PYTHON}", PATH=f"{tmp_path}:/usr/bin:/bin")
    assert "--index-url https://download.pytorch.org/whl/cpu" in _torch_line(out), out.stdout


def test_with_a_gpu_torch_is_the_default_build(tmp_path):
    fake = tmp_path / "nvidia-smi"  # lists a GPU, as nvidia-smi -L does
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    fake.chmod(0o755)
    out = _make("-n", "-B", "install", f"SYSTEM_PYTHON={BASE_PYTHON}", PATH=f"{tmp_path}:/usr/bin:/bin")
    assert "--index-url" not in _torch_line(out) and '"torch==2.13.0"' in _torch_line(out), out.stdout


def test_install_compiles_the_extension_once_the_editable_install_builds_it():
    lines = _make("-n", "-B", "install", f"SYSTEM_PYTHON={BASE_PYTHON}").stdout.splitlines()
    assert sum("pip install --no-build-isolation -e" in ln for ln in lines) == 1
    build = [i for i, ln in enumerate(lines) if "setup.py -q build_ext --inplace" in ln]
    assert len(build) == 1 and "||" in lines[build[0] - 1], "build_ext runs only when the build is stale"
