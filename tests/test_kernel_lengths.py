"""Kernels check what they are given (issue 27): the C layer reads no vector of the weights past its length, and
its status codes become exceptions in one place (ringshm.errors). The C-only side, under AddressSanitizer, is
csrc/test_lengths.c (make test-c)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from ringshm import errors
from ringshm._C import lib


def test_the_status_codes_mirrored_in_errors_are_the_builds():
    for name in ("KERNEL_ERR_SHAPE", "KERNEL_ERR_RANGE", "KERNEL_ERR_LENGTH", "MATMUL_ERR_TYPE", "MATMUL_ERR_SHAPE",
                 "MATMUL_ERR_SIZE", "MATMUL_ERR_ALIAS"):
        assert getattr(errors, name) == getattr(lib, f"RINGSHM_{name}"), name
    with pytest.raises(errors.KernelError, match="rms_norm: a tensor's length"):
        errors.check_status(lib.RINGSHM_KERNEL_ERR_LENGTH, "rms_norm")
    with pytest.raises(errors.KVRangeError):
        errors.check_status(lib.RINGSHM_KERNEL_ERR_RANGE)


# A norm of 32 floats (hidden is 64) placed so that its end is the end of a readable page, the next page
# PROT_NONE: a layer that reads `hidden` floats from it faults (what a malformed file did to csrc/layer.c).
_GUARD_PAGE = textwrap.dedent("""
    import ctypes, mmap, sys, tempfile
    from pathlib import Path
    import torch
    sys.path.insert(0, "tests")
    from checkpoint_corpus import write_hf
    from ringshm.errors import KernelError
    from ringshm.model.loader import Checkpoint
    from ringshm.model.stage_model import StageModel

    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 2 * page)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(ctypes.addressof(ctypes.c_char.from_buffer(buf)) + page, page, 0) == 0  # PROT_NONE
    short = torch.frombuffer(buf, dtype=torch.float32, count=32, offset=page - 128)
    short.fill_(1.0)
    path = write_hf(Path(tempfile.mkdtemp()) / "hf")  # valid: the check passes; the short norm comes after it
    ckpt = Checkpoint.open(path)
    weights = ckpt.load_stage((0, ckpt.config.n_layers), True, True)
    weights.layers[0].attn_norm = short
    stage = StageModel(ckpt.config, (0, ckpt.config.n_layers), True, True, 1, 16, weights=weights)
    try:
        stage.forward(torch.tensor([1, 2, 3]), row=0, start=0)
    except KernelError as exc:
        print("refused:", exc)
    else:
        print("ran")
""")


def test_a_norm_shorter_than_hidden_is_refused_by_the_c_layer_never_read_past_its_end():
    out = subprocess.run([sys.executable, "-c", _GUARD_PAGE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode} (a negative code is the signal that killed it)\n{out.stderr}"
    assert out.stdout.startswith("refused: layer 0: the C layer refused the op: a tensor's length"), out.stdout
