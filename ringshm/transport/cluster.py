"""Stages on several hosts: where the nodes meet and how they prove they belong together (what each node then
runs: ``ringshm.runtime.launcher.NodePlan``).

The coordinator's host is node 0 (the head); every other host runs ``ringshm worker`` (``ringshm.runtime.worker``).
Stages are split over the nodes in order (``EngineConfig.node_stage_ranges``); inside a node every hop is a
shared-memory ring, between nodes a pair of bridges (``ringshm.transport.bridge``). With 2 nodes of 2 stages::

    node 0: coordinator ─▶ stage 0 ─▶ stage 1 ─▶ bridge ══ edge 2 ══▶ bridge ─▶ stage 2 ─▶ stage 3 ─▶ bridge  :node 1
            coordinator ◀─────────────────────── bridge ◀══════════════ edge 4 ════════════════════════╝

Rendezvous (JSON over the head's TCPStore, no pickle). The head serves the store at ``master_addr:master_port``
and posts ``ringshm/hello``: the wire version, the engine config, the model path and its fingerprint, the
session id (the key prefix of every edge) and a nonce. A worker (which may start first: it waits up to
``wait_s`` for the head) checks the wire version and the model fingerprint (of its own copy: ``--model`` or the
head's path), writes its answer under a key of its own, ``ringshm/node<r>/<its nonce>`` (its nonce and an HMAC of
both nonces under the shared token, ``--token`` / ``RINGSHM_TOKEN``; none = the empty key), and queues its nonce
on ``ringshm/join<r>``. The head takes the queued answers in order, checks each proof and answers
``ringshm/ack<r>/<nonce>`` with its own, which the worker checks in turn. Nothing is claimed before the head has
checked the proof, so a worker with a wrong token (or a stranger's junk) is refused without holding the rank
from the worker that has the right one; the first proven answer takes the rank (``ringshm/joined<r>``) and later
ones are refused. Any mismatch is refused by name, before a stage starts; an unproven answer does not end the
head's wait (``Head``). The store listens on ``master_addr`` only; without a token, anyone who reaches it may
join.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta

from ringshm.config import EngineConfig
from ringshm.errors import ClusterRefused

HELLO_KEY = "ringshm/hello"
TOKEN_ENV = "RINGSHM_TOKEN"  # the one environment variable: a secret does not belong on a command line (ps)
DEFAULT_PORT = 29500  # torch.distributed's customary master port


def wire_version() -> str:
    """The record format and the edge format, ``"<messages.VERSION>.<edge.VERSION>"``: nodes must agree."""
    from ringshm.transport import edge, messages

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


def _proof(token: str | None, message: str) -> str:
    return hmac.new((token or "").encode(), message.encode(), hashlib.sha256).hexdigest()


SLICE_S = 1.0  # every rendezvous wait is cut into slices this long: signals and deadlines are honoured between
MAX_ANSWERS = 1000  # answers the head examines for one node before it gives up (each is a few store round trips)
_NONCE = re.compile(r"[0-9a-f]{32}")  # a worker's nonce: secrets.token_hex(16)
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_interrupted() -> None:
    """Raise KeyboardInterrupt when a stop signal is pending (``ringshm serve`` blocks them while the engine
    starts; between slices of a rendezvous wait they must still stop it)."""
    if signal.pthread_sigmask(signal.SIG_BLOCK, []) & _STOP_SIGNALS and signal.sigpending() & _STOP_SIGNALS:
        raise KeyboardInterrupt


def _serve_store(rdv: Rendezvous):
    """The head's TCPStore, listening on ``master_addr`` only (a socket bound here and handed over: the store
    owns and closes it), and the address it listens on. Raises ClusterRefused when the address or port cannot be
    had."""
    import torch.distributed as dist

    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(rdv.master_addr, rdv.master_port,
                                                          type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        store = dist.TCPStore(rdv.master_addr, rdv.master_port, None, True, timedelta(seconds=SLICE_S),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except (OSError, RuntimeError, ValueError) as exc:
        if sock is not None:
            sock.close()
        raise ClusterRefused(f"cannot serve the rendezvous on {rdv.master_addr}:{rdv.master_port} ("
                             f"{_first_line(exc)}): give an address of this host (--master-addr) and a free "
                             f"--master-port") from None
    bound = sock.getsockname()
    sock.detach()  # the store owns the descriptor now
    return store, bound


def _connect_store(rdv: Rendezvous, deadline: float):
    """A client of the head's TCPStore, retrying in ``SLICE_S`` slices until ``deadline`` (monotonic)."""
    import torch.distributed as dist

    last = "nothing answered"
    while True:
        check_interrupted()
        try:
            return dist.TCPStore(rdv.master_addr, rdv.master_port, None, False, timedelta(seconds=SLICE_S),
                                 wait_for_workers=False)
        except (RuntimeError, ValueError) as exc:
            last = _first_line(exc)
        if time.monotonic() >= deadline:
            raise ClusterRefused(f"no head at {rdv.master_addr}:{rdv.master_port} within {rdv.wait_s:g} s ({last}): "
                                 f"start `ringshm serve/generate --nnodes N --node-rank 0` there, or check the "
                                 f"address and port")
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def _wait_value(store, key: str, deadline: float) -> bytes | None:
    """The value of ``key`` once it exists, or None at ``deadline``; waits in ``SLICE_S`` slices.

    Raises:
        ClusterRefused: the store is gone (the connection to it failed).
    """
    import torch.distributed as dist

    while True:
        check_interrupted()
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            store.wait([key], timedelta(seconds=min(SLICE_S, left)))
            return store.get(key)
        except dist.DistNetworkError as exc:
            raise ClusterRefused(f"the rendezvous store went away ({_first_line(exc)})") from None
        except RuntimeError:  # DistStoreError: this slice timed out
            continue


def _parse(raw: bytes | None) -> dict | None:
    """A JSON object, or None for anything else (bad UTF-8, bad JSON, another type)."""
    try:
        value = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


class Head:
    """Node 0's side of the rendezvous: serves the store, posts the HELLO, checks every worker's answer.

    An answer whose proof of the token does not check out (or that is not an answer at all) is refused and
    otherwise ignored: the head keeps waiting for a worker that proves it, so a stranger who can reach the
    port cannot end the session (a worker with the wrong token learns why from its own refusal). A worker
    that proves itself and refuses (wire version, model fingerprint) ends the startup at once.

    Args:
        rdv: where to meet (``node_rank`` must be 0). cfg: the engine config (sent to the workers).
        model_path: the model (its path goes into the HELLO). model_fingerprint: the model's and the split's
            (``ringshm.model.fingerprint.fingerprint``), which every worker's own must equal.
        max_seq_len: KV positions per row (the head's cap, so every node sizes its cache alike).
        log: where progress lines go (waiting for node r, refused answers).

    Raises:
        ValueError: node_rank is not 0 (other nodes run ``ringshm worker``).
        ClusterRefused: the address or port cannot be served, no proven worker joined within ``wait_s`` (the
            message names the last refused answer), or a proven worker refused, naming the node and reason.
        KeyboardInterrupt: a stop signal arrived while waiting.
    """

    def __init__(self, rdv: Rendezvous, cfg: EngineConfig, model_path: str, model_fingerprint: str,
                 max_seq_len: int, log=lambda text: None):
        if rdv.node_rank != 0:
            raise ValueError(f"the coordinator is node 0, got node_rank={rdv.node_rank}: run `ringshm worker` on "
                             f"the other nodes")
        self.rdv = rdv
        self.session = secrets.token_hex(8)
        self.store, self.address = _serve_store(rdv)
        nonce = secrets.token_hex(16)
        hello = {"wire": wire_version(), "session": self.session, "nnodes": cfg.nnodes, "config": asdict(cfg),
                 "model": model_path, "fingerprint": model_fingerprint,
                 "max_seq_len": max_seq_len, "nonce": nonce}
        self.store.set(HELLO_KEY, json.dumps(hello))
        self.hosts = [rdv.local_addr()] + [""] * (cfg.nnodes - 1)
        deadline = time.monotonic() + rdv.wait_s
        for r in range(1, cfg.nnodes):
            log(f"waiting for node {r}: `ringshm worker --nnodes {cfg.nnodes} --node-rank {r} --master-addr "
                f"{rdv.master_addr} --master-port {rdv.master_port}` (up to {rdv.wait_s:g} s)")
            self.hosts[r] = self._admit(r, nonce, deadline, log)

    def _admit(self, r: int, nonce: str, deadline: float, log) -> str:
        """Take node ``r``'s queued answers in order until one proves the token, acknowledge it and mark the rank
        taken; returns its address. A refused answer is told so and frees nothing, since nothing was held."""
        queue, n_seen, refused = f"ringshm/join{r}", 0, ""
        while True:
            raw = _wait_value(self.store, queue, deadline)
            if raw is None:
                raise ClusterRefused(f"node {r} did not join within {self.rdv.wait_s:g} s" + (
                    f"; refused meanwhile: {refused}" if refused else
                    f": start `ringshm worker --node-rank {r} --master-addr {self.rdv.master_addr} --master-port "
                    f"{self.rdv.master_port} ...` on it"))
            queued = raw.split(b"\n")[:-1]  # complete entries only
            if len(queued) <= n_seen:
                time.sleep(0.05)  # nothing new yet: the queue key exists, so the store's wait returns at once
                continue
            for entry in queued[n_seen:MAX_ANSWERS]:
                n_seen += 1
                theirs = entry.decode("ascii", "replace")
                key = f"ringshm/node{r}/{theirs}"
                answer = _parse(self.store.get(key)) if _NONCE.fullmatch(theirs) and self.store.check([key]) else None
                if answer is None or not hmac.compare_digest(str(answer.get("proof", "")),
                                                             _proof(self.rdv.token, f"worker:{r}:{nonce}:{theirs}")):
                    refused = ("an answer that is not a JSON object" if answer is None else
                               f"a worker at {answer.get('bind_addr', '?')} whose token does not match this head's "
                               f"(give every node the same --token or {TOKEN_ENV})")
                    log(f"node {r}: refused {refused}")
                    if answer is not None:
                        self.store.set(f"ringshm/ack{r}/{theirs}",
                                       json.dumps({"ok": False, "error": "token: the head's token differs"}))
                    continue
                where = f"node {r} ({answer.get('bind_addr', '?')})"
                if answer.get("error"):
                    raise ClusterRefused(f"{where} refused to join: {answer['error']}")
                self.store.set(f"ringshm/joined{r}", theirs)
                self.store.set(f"ringshm/ack{r}/{theirs}", json.dumps(
                    {"ok": True, "proof": _proof(self.rdv.token, f"head:{r}:{theirs}"), "hosts": self.hosts[:r]}))
                return str(answer.get("bind_addr", ""))
            if n_seen >= MAX_ANSWERS:
                raise ClusterRefused(f"node {r}: {MAX_ANSWERS} answers refused ({refused}): the rendezvous port is "
                                     f"being flooded, or every worker has the wrong token")

    def close(self) -> None:
        """Stop serving the store (the edges no longer need it once formed)."""
        self.store = None


def join(rdv: Rendezvous, nnodes: int, fingerprint_of) -> tuple[dict, object]:
    """A worker's side of the rendezvous: wait for the head's HELLO, check it, answer, check the head's proof.

    ``fingerprint_of(hello)``: this node's fingerprint of the model the HELLO names (it may raise, e.g. the
    model is not on this node). Returns ``(hello, store)``. Every wait is cut into slices, so the whole takes
    at most about ``wait_s`` and a stop signal ends it.

    Raises:
        ClusterRefused: no head within ``wait_s``, a wire version, node count or fingerprint that differs, a
            node rank already taken, or a token that differs (either way round).
        KeyboardInterrupt: a stop signal arrived while waiting.
    """
    deadline = time.monotonic() + rdv.wait_s
    store = _connect_store(rdv, deadline)
    r = rdv.node_rank
    where = f"the head at {rdv.master_addr}:{rdv.master_port}"
    hello = _parse(_wait_value(store, HELLO_KEY, deadline))
    if hello is None:
        raise ClusterRefused(f"{where} posted no HELLO within {rdv.wait_s:g} s (is it a ringshm head?)")
    taken = f"node rank: another worker already joined {where} as node {r}"
    if store.check([f"ringshm/joined{r}"]):
        raise ClusterRefused(taken)
    error = None
    if hello.get("wire") != wire_version():
        error = (f"wire version: the head speaks {hello.get('wire')!r}, this worker {wire_version()!r}: run the same "
                 f"ringshm version on every node")
    elif hello.get("nnodes") != nnodes:
        error = f"nnodes: the head runs {hello.get('nnodes')} nodes, this worker was started with --nnodes {nnodes}"
    elif not 1 <= r < nnodes:
        error = f"node rank: this worker is node {r}, ranks 1-{nnodes - 1} are workers"
    else:
        try:
            mine = fingerprint_of(hello)
            if mine != hello.get("fingerprint"):
                error = (f"model fingerprint: this node's model differs from the head's {hello.get('model')!r} "
                         f"(config, layer split or weights): give every node the same checkpoint")
        except Exception as exc:  # noqa: BLE001 - whatever stops this node loading the model is its answer
            error = f"model: {type(exc).__name__}: {exc}"
    nonce = secrets.token_hex(16)
    store.set(f"ringshm/node{r}/{nonce}", json.dumps({
        "wire": wire_version(), "nonce": nonce, "bind_addr": rdv.local_addr(), "error": error,
        "proof": _proof(rdv.token, f"worker:{r}:{hello.get('nonce', '')}:{nonce}")}))
    store.append(f"ringshm/join{r}", f"{nonce}\n")  # the answer is written first: the head reads it by this nonce
    if error:
        raise ClusterRefused(f"refused to join {where}: {error}")
    # The wait for the head's answer starts now, not when this worker started waiting for a head: the head
    # admits nodes in rank order, within its own startup timeout (in its HELLO), however late it came.
    answer_s = _answer_wait_s(hello, rdv.wait_s)
    until = time.monotonic() + answer_s
    while True:  # in slices: another worker may take the rank first (then this one is refused at once)
        ack = _parse(_wait_value(store, f"ringshm/ack{r}/{nonce}", min(until, time.monotonic() + SLICE_S)))
        if ack is not None:
            break
        if store.check([f"ringshm/joined{r}"]):
            raise ClusterRefused(taken)
        if time.monotonic() >= until:
            raise ClusterRefused(f"{where} did not answer this node's HELLO within {answer_s:g} s")
    if not ack.get("ok"):
        raise ClusterRefused(f"{where} refused this node: {ack.get('error')} (give every node the same --token or "
                             f"{TOKEN_ENV})")
    if not hmac.compare_digest(str(ack.get("proof", "")), _proof(rdv.token, f"head:{r}:{nonce}")):
        raise ClusterRefused(f"token: {where} does not know this worker's token: refusing it (give every node the "
                             f"same --token or {TOKEN_ENV})")
    hello["hosts"] = ack.get("hosts", [])
    return hello, store


def _answer_wait_s(hello: dict, wait_s: float) -> float:
    """How long a worker waits for the head's answer once it has answered: the head's startup timeout (the
    longest the head itself waits for its nodes), else the worker's ``wait_s``."""
    try:
        head_s = float((hello.get("config") or {}).get("startup_timeout_s", wait_s))
    except (TypeError, ValueError, AttributeError):
        head_s = wait_s
    return head_s if 0 < head_s <= 86400 else wait_s


def config_from_hello(hello: dict, model_path: str) -> EngineConfig:
    """The head's ``EngineConfig`` from its HELLO (lists back to tuples), with this node's model path."""
    c = dict(hello["config"])
    for key in ("layer_split", "node_stages"):
        if c.get(key) is not None:
            c[key] = tuple(c[key])
    c["model"] = model_path
    return EngineConfig(**c)
