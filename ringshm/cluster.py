"""Stages on several hosts: where the nodes meet, how they prove they belong together, who runs what.

The coordinator's host is node 0 (the head); every other host runs ``ringshm worker`` (``ringshm.worker``).
Stages are split over the nodes in order (``EngineConfig.node_stage_ranges``); inside a node every hop is a
shared-memory ring, between nodes a pair of bridges (``ringshm.bridge``). With 2 nodes of 2 stages::

    node 0: coordinator ─▶ stage 0 ─▶ stage 1 ─▶ bridge ══ edge 2 ══▶ bridge ─▶ stage 2 ─▶ stage 3 ─▶ bridge  :node 1
            coordinator ◀─────────────────────── bridge ◀══════════════ edge 4 ════════════════════════╝

Rendezvous (JSON over the head's TCPStore, no pickle). The head serves the store at ``master_addr:master_port``
and posts ``ringshm/hello``: the wire version, the engine config, the model path and its fingerprint, the
session id (the key prefix of every edge) and a nonce. A worker (which may start first: it waits up to
``wait_s`` for the head) claims its node rank, checks the wire version and the model fingerprint (of its own
copy: ``--model`` or the head's path), and answers ``ringshm/node<r>`` with its nonce and an HMAC of both
nonces under the shared token (``--token`` / ``RINGSHM_TOKEN``; none = the empty key). The head checks that
proof and answers ``ringshm/ack<r>`` with its own, which the worker checks in turn. Any mismatch is refused by
name on both sides, before a stage starts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import socket
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

from ringshm.config import EngineConfig, ModelConfig
from ringshm.errors import ClusterRefused

HELLO_KEY = "ringshm/hello"
TOKEN_ENV = "RINGSHM_TOKEN"  # the one environment variable: a secret does not belong on a command line (ps)
DEFAULT_PORT = 29500  # torch.distributed's customary master port


def connect_timeout_s(cfg: EngineConfig) -> float:
    """How long an edge may take to form: both ends' bridges start within seconds of the rendezvous (an
    interpreter and torch to import), so 2 minutes, or ``startup_timeout_s`` if shorter. A peer that died in
    between is noticed then instead of after a long startup timeout."""
    return min(cfg.startup_timeout_s, 120.0)


def wire_version() -> str:
    """The record format and the edge format, ``"<messages.VERSION>.<edge.VERSION>"``: nodes must agree."""
    from ringshm import edge, messages

    return f"{messages.VERSION}.{edge.VERSION}"


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one engine meet.

    Args:
        node_rank: this host's node (0 = the head, which runs the coordinator).
        master_addr, master_port: the head's TCPStore (the head serves it; workers connect to it).
        bind_addr: the local address the edges bind (gloo); None = ``master_addr`` on the head, on a worker
            the local address that routes to ``master_addr``.
        token: the shared secret both sides must know (None = none; then both must have none).
        wait_s: how long to wait for the other side (a worker for the head, the head for its workers).

    Raises:
        ValueError: a port outside 1-65535, a negative rank, an empty address, wait_s <= 0.
    """

    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    bind_addr: str | None = None
    token: str | None = field(default=None, repr=False)
    wait_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) or self.node_rank < 0:
            raise ValueError(f"node_rank must be an int >= 0, got {self.node_rank!r}")
        if not isinstance(self.master_port, int) or not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port must be a TCP port in 1-65535, got {self.master_port!r}")
        if not self.master_addr:
            raise ValueError("master_addr is empty: give the head's address (--master-addr)")
        if not self.wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {self.wait_s!r}")

    def local_addr(self) -> str:
        """``bind_addr``, or the local address of the route to ``master_addr`` (no packet is sent)."""
        if self.bind_addr:
            return self.bind_addr
        if self.node_rank == 0:
            return self.master_addr
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.master_addr, self.master_port))
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"


def fingerprint(model_path: str | Path, mc: ModelConfig, layer_ranges: list[range], samples: int = 64) -> str:
    """A sha256 over the model config, the layer split and the checkpoint's bytes where they differ between
    models: each tensor file's size, its first MiB (GGUF metadata and tensor table; a safetensors header) and
    ``samples`` 4 KiB blocks spread over it. Cheap for any size (a full hash of a 70 GB file takes minutes),
    and a different quantization, fine-tune or split changes it."""
    h = hashlib.sha256()
    h.update(json.dumps(asdict(mc), sort_keys=True).encode())
    h.update(json.dumps([[r.start, r.stop] for r in layer_ranges]).encode())
    p = Path(model_path)
    for f in [p] if p.is_file() else sorted(p.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(str(size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            for i in range(samples):
                fh.seek(i * size // samples)
                h.update(fh.read(4096))
    return h.hexdigest()


def _proof(token: str | None, message: str) -> str:
    return hmac.new((token or "").encode(), message.encode(), hashlib.sha256).hexdigest()


def _store(rdv: Rendezvous, is_head: bool):
    """The head's TCPStore (served here when ``is_head``, else a client that waits up to ``wait_s`` for it)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(rdv.master_addr, rdv.master_port, None, is_head, timedelta(seconds=rdv.wait_s),
                             wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if is_head:
            raise ClusterRefused(f"cannot serve the rendezvous on {rdv.master_addr}:{rdv.master_port} ({first}): "
                                 f"pick a free --master-port") from None
        raise ClusterRefused(f"no head at {rdv.master_addr}:{rdv.master_port} within {rdv.wait_s:g} s ({first}): "
                             f"start `ringshm serve/generate --nnodes N --node-rank 0` there, or check the address "
                             f"and port") from None


def _get_json(store, key: str, timeout_s: float, missing: str) -> dict:
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return json.loads(store.get(key))
    except (RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ClusterRefused(f"{missing} ({first})") from None


class Head:
    """Node 0's side of the rendezvous: serves the store, posts the HELLO, checks every worker's answer.

    Args:
        rdv: where to meet (``node_rank`` must be 0). cfg: the engine config (sent to the workers).
        model_path / mc / layer_ranges: the model and split (their fingerprint goes into the HELLO).
        max_seq_len: KV positions per row (the head's cap, so every node sizes its cache alike).

    Raises:
        ValueError: node_rank is not 0 (other nodes run ``ringshm worker``).
        ClusterRefused: the port is taken, a worker did not join within ``wait_s``, or a worker refused / was
            refused (wire version, model fingerprint, token), naming the node and the reason.
    """

    def __init__(self, rdv: Rendezvous, cfg: EngineConfig, model_path: str, mc: ModelConfig,
                 layer_ranges: list[range], max_seq_len: int):
        if rdv.node_rank != 0:
            raise ValueError(f"the coordinator is node 0, got node_rank={rdv.node_rank}: run `ringshm worker` on "
                             f"the other nodes")
        self.rdv = rdv
        self.session = secrets.token_hex(8)
        self.store = _store(rdv, True)
        nonce = secrets.token_hex(16)
        config = asdict(cfg)
        hello = {"wire": wire_version(), "session": self.session, "nnodes": cfg.nnodes, "config": config,
                 "model": model_path, "fingerprint": fingerprint(model_path, mc, layer_ranges),
                 "max_seq_len": max_seq_len, "nonce": nonce}
        self.store.set(HELLO_KEY, json.dumps(hello))
        self.hosts = [rdv.local_addr()] + [""] * (cfg.nnodes - 1)
        for r in range(1, cfg.nnodes):
            answer = _get_json(self.store, f"ringshm/node{r}", rdv.wait_s,
                               f"node {r} did not join within {rdv.wait_s:g} s: start `ringshm worker --nnodes "
                               f"{cfg.nnodes} --node-rank {r} --master-addr {rdv.master_addr} --master-port "
                               f"{rdv.master_port}` on it")
            self.hosts[r] = str(answer.get("bind_addr", "?"))
            where = f"node {r} ({self.hosts[r]})"
            if answer.get("error"):
                raise ClusterRefused(f"{where} refused to join: {answer['error']}")
            if not hmac.compare_digest(str(answer.get("proof", "")),
                                       _proof(rdv.token, f"worker:{r}:{nonce}:{answer.get('nonce', '')}")):
                self.store.set(f"ringshm/ack{r}", json.dumps({"ok": False, "error": "token: the head's token differs"}))
                try:  # keep serving the store until the worker has read why (its own message names the token)
                    self.store.wait([f"ringshm/read{r}"], timedelta(seconds=5))
                except RuntimeError:
                    pass
                raise ClusterRefused(f"{where} was refused: its token does not match this head's (give every node "
                                     f"the same --token or {TOKEN_ENV})")
            self.store.set(f"ringshm/ack{r}", json.dumps(
                {"ok": True, "proof": _proof(rdv.token, f"head:{r}:{answer['nonce']}"), "hosts": self.hosts[:r + 1]}))

    def close(self) -> None:
        """Stop serving the store (the edges no longer need it once formed)."""
        self.store = None


def join(rdv: Rendezvous, fingerprint_of) -> tuple[dict, object]:
    """A worker's side of the rendezvous: wait for the head's HELLO, check it, answer, check the head's proof.

    ``fingerprint_of(hello)``: this node's fingerprint of the model the HELLO names (it may raise, e.g. the
    model is not on this node). Returns ``(hello, store)``.

    Raises:
        ClusterRefused: no head within ``wait_s``, a wire version or fingerprint that differs, a node rank
            already taken or outside the head's ``nnodes``, or a token that differs (either way round).
    """
    store = _store(rdv, False)
    r = rdv.node_rank
    hello = _get_json(store, HELLO_KEY, rdv.wait_s, f"the head at {rdv.master_addr}:{rdv.master_port} posted no "
                                                    f"HELLO within {rdv.wait_s:g} s")
    error = None
    if hello.get("wire") != wire_version():
        error = (f"wire version: the head speaks {hello.get('wire')!r}, this worker {wire_version()!r}: run the same "
                 f"ringshm version on every node")
    elif not 1 <= r < int(hello.get("nnodes", 0)):
        error = (f"node rank: this worker is node {r}, the head runs {hello.get('nnodes')} nodes (ranks 1-"
                 f"{int(hello.get('nnodes', 1)) - 1} are workers)")
    elif store.add(f"ringshm/claim{r}", 1) > 1:
        error = f"node rank: another worker already joined as node {r}"
    else:
        try:
            mine = fingerprint_of(hello)
            if mine != hello.get("fingerprint"):
                error = (f"model fingerprint: this node's model differs from the head's {hello.get('model')!r} "
                         f"(config, layer split or weights): give every node the same checkpoint")
        except Exception as exc:  # noqa: BLE001 - whatever stops this node loading the model is its answer
            error = f"model: {type(exc).__name__}: {exc}"
    nonce = secrets.token_hex(16)
    store.set(f"ringshm/node{r}", json.dumps({
        "wire": wire_version(), "nonce": nonce, "bind_addr": rdv.local_addr(), "error": error,
        "proof": _proof(rdv.token, f"worker:{r}:{hello.get('nonce', '')}:{nonce}")}))
    if error:
        raise ClusterRefused(f"refused to join the head at {rdv.master_addr}:{rdv.master_port}: {error}")
    ack = _get_json(store, f"ringshm/ack{r}", rdv.wait_s, "the head did not answer this node's HELLO")
    store.set(f"ringshm/read{r}", "1")
    if not ack.get("ok"):
        raise ClusterRefused(f"the head refused this node: {ack.get('error')} (give every node the same --token or "
                             f"{TOKEN_ENV})")
    if not hmac.compare_digest(str(ack.get("proof", "")), _proof(rdv.token, f"head:{r}:{nonce}")):
        raise ClusterRefused(f"token: the head at {rdv.master_addr}:{rdv.master_port} does not know this worker's "
                             f"token: refusing it (give every node the same --token or {TOKEN_ENV})")
    hello["hosts"] = ack.get("hosts", [])
    return hello, store


def config_from_hello(hello: dict, model_path: str) -> EngineConfig:
    """The head's ``EngineConfig`` from its HELLO (lists back to tuples), with this node's model path."""
    c = dict(hello["config"])
    for key in ("layer_split", "node_stages"):
        if c.get(key) is not None:
            c[key] = tuple(c[key])
    c["model"] = model_path
    return EngineConfig(**c)


@dataclass(frozen=True)
class NodePlan:
    """What one node runs: its stages, its rings' neighbours across hosts, and how its bridges meet.

    ``stages``: the global indices of this node's stages; ``node_ranges``: every node's. Ring ``i`` is stage
    ``i``'s input (ring ``n_stages``: the replies). A node owns rings ``stages.start .. stages.stop``; node 0 of
    a multi-node engine also owns the coordinator's reply ring, fed by the return edge.
    """

    node: int
    node_ranges: tuple[range, ...]
    n_stages: int
    store_addr: str = "127.0.0.1"
    store_port: int = DEFAULT_PORT
    session: str = ""
    bind_addr: str = "127.0.0.1"
    timeout_s: float = 5.0
    connect_timeout_s: float = 600.0
    latency_ms: float = 0.0
    hosts: tuple[str, ...] = ()

    @property
    def stages(self) -> range:
        return self.node_ranges[self.node]

    @property
    def nnodes(self) -> int:
        return len(self.node_ranges)

    def node_of(self, stage: int) -> int:
        """The node running ``stage``."""
        return next(j for j, r in enumerate(self.node_ranges) if stage in r)

    def host(self, node: int) -> str:
        """How messages name ``node``: ``node 1 (10.0.0.2)`` where its address is known."""
        addr = self.hosts[node] if node < len(self.hosts) and self.hosts[node] else ""
        return f"node {node} ({addr})" if addr else f"node {node}"

    def edges(self) -> list[tuple[int, int, int]]:
        """This node's bridges as ``(edge, rank, remote stage)``: rank 0 sends (its ring's producer is here),
        rank 1 receives; the remote stage is the one across the edge (-1: the coordinator)."""
        if self.nnodes == 1:
            return []
        out = []
        if self.node > 0:  # ring stages.start comes from the previous node
            out.append((self.stages.start, 1, self.stages.start - 1))
        stop = self.stages.stop  # ring stages.stop goes to the next node, or back to the coordinator
        out.append((stop, 0, stop if stop < self.n_stages else -1))
        if self.node == 0:
            out.append((self.n_stages, 1, self.n_stages - 1))
        return out
