"""How stage and bridge processes start: from a fork server that has imported torch once, with libgomp's spin
count set, and how a child that finds itself re-running an unguarded main script stops (``launcher`` starts the
processes of a ``StageGroup`` with these).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from contextlib import contextmanager

from ringshm.errors import StageDied, StageStartupError

# libgomp (the OpenMP of torch and of ringshm's matmul) keeps a worker spinning after each parallel region. A
# stage that has just finished an op then burns a core the next stage wants. With the quantized C matmul (120
# short parallel regions per decode token, ~10 ms a token), on 2 cores, 3-stage / 1-stage decode tok/s measured
# 0.73 with 50k (the value tuned for torch's fp32 GEMMs), 0.42 with 200k, 0.66-0.80 with 20k, 0.83-0.86 with
# 10k, 0.97-1.03 with 5k, 0.95 with 2k and 0.88 with 0 (every region then pays a wake-up; 1 stage loses 12 %).
# Children get 5k unless the caller set a spin count itself.
_CHILD_ENV = {"GOMP_SPINCOUNT": "5000"}


@contextmanager
def _child_env():
    """The environment the fork server starts with, and so every stage and bridge forked from it: libgomp's
    spin count (see _CHILD_ENV) unless already set. (Each stage's GPU is set by the stage itself, before CUDA
    starts: StageSpec.gpu.)"""
    changes = {k: v for k, v in _CHILD_ENV.items() if k not in os.environ}
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# What the fork server imports once, so that a stage or bridge forked from it starts without importing them (torch
# alone took 2.7 s of CPU per process on this 2-vCPU VM: a 3-stage engine was ready in 5.1 s, now ~1 s after the
# first; README, "Start-up").
FORKSERVER_PRELOAD = ["torch", "ringshm._C", "ringshm.runtime.stage", "ringshm.model.loader",
                      "ringshm.model.stage_model", "ringshm.transport.bridge"]


def process_context():
    """The multiprocessing context stages and bridges start from: ``forkserver``, whose server (one per parent
    process, started at the first engine and kept until the parent exits) has imported FORKSERVER_PRELOAD.

    A fork server, not plain ``fork``: the server is a fresh process (started by fork + exec, without the
    caller's threads, CUDA context or locks), so forking it is safe whatever the caller does; not ``spawn``,
    which re-imports torch in every child. Neither CUDA nor OpenMP's threads start in the server (torch starts
    both lazily): each stage picks its GPU and thread count before its first op. The caller's main module is
    not preloaded: each child imports it as spawn's children do (``refuse_in_spawn_bootstrap``).
    """
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    with _child_env():  # libgomp reads its spin count when torch loads it, i.e. in the server
        forkserver.ensure_running()
    return ctx


# A stage process that finds itself re-running its parent's main module exits with this (EX_CONFIG).
UNGUARDED_MAIN_EXIT = 78


def refuse_in_spawn_bootstrap() -> None:
    """Stop a process that is importing its parent's main module to start as a spawned child, before it starts
    stages of its own.

    Stages are spawned: each child first re-runs the parent script's top level (as ``__mp_main__``) to find the
    function it runs. A script that starts an ``Engine`` at its top level, without an ``if __name__ ==
    "__main__":`` guard, thus starts an Engine in every child during that bootstrap, which multiprocessing
    refuses with a traceback per stage (~120 lines for 3 stages). ``multiprocessing`` marks the bootstrap with
    ``current_process()._inheriting`` (its own check, ``spawn._check_not_importing_main``, reads the same flag);
    then this exits at once and quietly with ``UNGUARDED_MAIN_EXIT``, which the parent turns into one error
    saying what to add (``StageGroup.wait_ready``). Called first by ``Engine`` and ``StageGroup``.
    """
    from multiprocessing import current_process

    if getattr(current_process(), "_inheriting", False):
        # os._exit, not SystemExit: a forked server's child turns any exception of its bootstrap into exit 1
        sys.stdout.flush()
        os._exit(UNGUARDED_MAIN_EXIT)


def unguarded_main_error(exc: StageDied) -> StageStartupError:
    script = getattr(sys.modules.get("__main__"), "__file__", None) or "the main script"
    return StageStartupError(
        f"stage {exc.stage} stopped while it started: it re-ran the top level of {script} and met the code that "
        f"starts the engine there. Each stage process imports the main module again: put the code "
        f"that creates the Engine under `if __name__ == \"__main__\":`", exc.stage)
