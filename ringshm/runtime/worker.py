"""``ringshm worker``: run this host's share of a multi-host engine (``ringshm.transport.cluster``) until the head
is done.

    ringshm worker --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 [--model PATH]

The worker learns the model, the split and every engine option from the head's HELLO; it loads its own copy of
the model (``--model``, else the head's path, which must then exist here) and is refused if its fingerprint
differs. It then starts its stages and bridges and watches them. It ends when they end: 0 after the head shut
the engine down (the SHUTDOWN op crossed every node), 1 when an edge or a stage failed (the head gone, a stage
killed); either way every process it started is reaped and every segment it made is unlinked. One engine per
run: a supervisor (systemd, a container restart policy) starts it again for the next head.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ringshm.model.fingerprint import fingerprint
from ringshm.transport.cluster import DEFAULT_PORT, Rendezvous, config_from_hello, join
from ringshm.transport.error_buffer import read_error

POLL_S = 0.1


def _local_model(hello: dict, model: str | None):
    """(path, EngineConfig, ModelConfig, layer ranges) of this node's copy of the head's model.

    Raises:
        FileNotFoundError: the model is not on this node.
    """
    from ringshm.model.loader import read_config

    path = model or hello["model"]
    if not Path(path).exists():
        raise FileNotFoundError(f"the head's model {path!r} is not on this node: pass --model with a local copy")
    cfg = config_from_hello(hello, str(path))
    mc = read_config(path)
    ranges = cfg.layer_ranges(mc.n_layers)
    return str(path), cfg, mc, ranges


def run_worker(nnodes: int, node_rank: int, master_addr: str = "127.0.0.1", master_port: int = DEFAULT_PORT,
               model: str | None = None, token: str | None = None, bind_addr: str | None = None,
               wait_s: float = 600.0, log=None) -> int:
    """Join the head at ``master_addr:master_port`` as node ``node_rank`` of ``nnodes``, run this node's stages
    and bridges, and return when they have ended: 0 after a clean shutdown by the head, 1 after a failure.

    ``token``: the shared secret (None: ``$RINGSHM_TOKEN``, else none). ``wait_s``: how long to wait for the
    head (the worker may start first). ``log(text)``: where progress lines go (default: stderr).

    Raises:
        ValueError: node_rank is not a worker's (1 .. nnodes-1).
        ClusterRefused: no head within ``wait_s``, or a refusal either way (wire version, model fingerprint,
            token, node rank), naming it.
        ResourceShortage: this node's stages do not fit its memory or /dev/shm.
    """
    import os

    from ringshm.runtime.launcher import NodePlan, StageGroup, connect_timeout_s
    from ringshm.runtime.resources import check_memory
    from ringshm.transport.cluster import TOKEN_ENV

    log = log or (lambda text: print(f"ringshm worker: {text}", file=sys.stderr, flush=True))
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 2:
        raise ValueError(f"nnodes must be an int >= 2 for a worker, got {nnodes!r}")
    if not 1 <= node_rank < nnodes:
        raise ValueError(f"a worker's node rank is 1..{nnodes - 1}, got {node_rank} (node 0 is the head: `ringshm "
                         f"serve` / `ringshm generate` with --nnodes)")
    rdv = Rendezvous(node_rank, master_addr, master_port, bind_addr,
                     os.environ.get(TOKEN_ENV) if token is None else token, wait_s)

    def check_here(hello: dict) -> str:
        path, cfg, mc, ranges = _local_model(hello, model)
        check_memory(cfg, mc, ranges, int(hello["max_seq_len"]), path,
                     local=cfg.node_stage_ranges()[node_rank])
        return fingerprint(path, mc, ranges)

    log(f"node {node_rank}/{nnodes}: waiting for the head at {master_addr}:{master_port}")
    hello, store = join(rdv, nnodes, check_here)
    path, cfg, mc, ranges = _local_model(hello, model)
    plan = NodePlan(node_rank, tuple(cfg.node_stage_ranges()), cfg.stages, master_addr, master_port,
                    hello["session"], rdv.local_addr(), cfg.edge_timeout_s, connect_timeout_s(cfg),
                    cfg.edge_latency_ms, tuple(hello.get("hosts", ())) + ("",) * nnodes)
    stages = plan.stages
    log(f"joined: stages {stages.start}-{stages.stop - 1} of {cfg.stages} (layers {ranges[stages.start].start}-"
        f"{ranges[stages.stop - 1].stop - 1}) from {path}")
    group = StageGroup(cfg, path, ranges, int(hello["max_seq_len"]), mc.hidden, mc.vocab, plan,
                       n_blocks=cfg.kv_blocks(mc, int(hello["max_seq_len"])))
    try:
        return watch(group, cfg.edge_timeout_s, log)
    finally:
        group.close()
        del store


def watch(group, settle_s: float, log) -> int:
    """Wait until a stage or bridge of ``group`` ends, give the rest ``settle_s`` to end on their own (after a
    SHUTDOWN every one does; after a failure the sending bridge first forwards what its stage sent), and
    return 0 when all ended cleanly, else 1 with the reason logged."""
    children = group.children
    while all(p.is_alive() for p in children):
        time.sleep(POLL_S)
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and any(p.is_alive() for p in children):
        time.sleep(POLL_S / 2)
    failed = [(p, slot) for slot, (p, *_) in enumerate(group.bridges) if p.exitcode != 0]
    if not failed and all(p.exitcode == 0 for p in children):
        log("the head shut the engine down; stages stopped")
        return 0
    reasons = [read_error(group.errors, group.cfg.stages + slot) or f"exit code {p.exitcode}" for p, slot in failed]
    reasons += [f"stage {i} exit code {p.exitcode}" for i, p in zip(group.plan.stages, group.procs)
                if p.exitcode not in (0, None)]
    log("stopping: " + "; ".join(reasons or ["a process did not end"]))
    return 1
