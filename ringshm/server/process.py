"""The ``ringshm serve`` process around the app (``ringshm.server.app``): the stages started with the stop
signals held, the app served by uvicorn on a socket bound before anything loaded (``ringshm.server.listen``),
and the exit status a supervisor reads (0 after a clean stop, ``STAGE_DIED_EXIT`` after a stage died)."""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from ringshm.engine.async_engine import AsyncEngine
from ringshm.engine.scheduler import window_fits_chain
from ringshm.errors import DispatcherFailed, StageDied
from ringshm.server.app import create_app
from ringshm.server.connection import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, read_timeout_protocol
from ringshm.server.listen import bind_listener


def model_id_of(model_path: str) -> str:
    """The served model's id: the checkpoint's file stem (or directory name)."""
    return Path(model_path).stem if Path(model_path).suffix == ".gguf" else Path(model_path).name


STAGE_DIED_EXIT = 3  # serve's exit status after a stage died or the dispatcher failed (for a supervisor: restart)


def keep_signal_mask() -> None:
    """Start multiprocessing's resource tracker now, before stop signals are blocked: Python (3.11) starts it on
    first use with SIGINT / SIGTERM blocked and then *unblocks* them in the calling thread, whatever the
    caller's mask was, which would let a signal through in the middle of the stages' startup."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


def serve(host: str = "127.0.0.1", port: int = 8000, *, sock: socket.socket | None = None, max_waiting: int = 64,
          graceful_s: float = 30.0,
          max_queue_wait_s: float | None = 60.0, max_body_bytes: int = 2 * 1024 * 1024,
          header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
          model_name: str | Sequence[str] | None = None, spec: str | None = None, spec_k: int = 4,
          spec_depth: int = 1, log_level: str = "info", tool_call_parser: str = "auto",
          **engine_kwargs) -> int:
    """Start the stages, then serve until SIGTERM / SIGINT / SIGHUP; returns 0 after a clean shutdown, and
    ``STAGE_DIED_EXIT`` (3) when a stage died or the engine's dispatcher failed: the open requests fail with 503,
    the server shuts down (every stage reaped, every segment unlinked) so that a supervisor (systemd
    ``Restart=on-failure``, Docker ``--restart``, Kubernetes) starts it afresh. A stalled stage is not fatal:
    see ``AsyncEngine``.

    ``model_name``: the name, or several aliases, the model is served under (default: ``model_id_of`` the
    checkpoint). ``engine_kwargs`` are ``Engine``'s. ``sock``: the listening socket (``bind_listener``), bound
    by the caller before anything loaded; None binds ``host:port`` here, still before the stages start. A
    stop signal while the stages load stops them at once and returns 0. uvicorn re-raises the signal it
    shut down on once it is done; ``serve`` treats that signal as the request for a clean exit, so the process
    exits 0. SIGHUP (the terminal closed, a supervisor's reload) is a stop signal like SIGTERM: open responses
    get ``graceful_s`` to finish. ``header_timeout_s`` / ``body_timeout_s``: how long a request's headers and
    body may take to arrive (``ringshm.server.connection.ReadTimeoutH11``). ``tool_call_parser``: ``create_app``'s.

    Raises:
        ValueError: the port is in use or out of range, before the stages start.
    """
    import uvicorn

    from ringshm.engine.engine import Engine

    http = read_timeout_protocol(header_timeout_s, body_timeout_s)  # refuses bad limits before anything loads
    if sock is None:
        sock = bind_listener(host, port)

    # The stages inherit ignored dispositions across spawn's exec (the mask they do not): a SIGINT / SIGTERM
    # sent to the whole process group (Ctrl-C, systemd) must reach only this process, which shuts the stages
    # down once the open responses end. Blocked meanwhile, one that arrives while the stages load stays
    # pending and is delivered after: the engine then closes again at once.
    stop_signals = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    received: list[int] = []
    keep_signal_mask()
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    # Ignoring a signal discards a pending one: one that came before this point (the caller may have blocked
    # them earlier, as the CLI does) is taken now, and nothing starts.
    if signal.sigpending() & stop_signals:
        signum = signal.sigwait(stop_signals)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        sock.close()
        print(f"ringshm: stopped by {signal.Signals(signum).name} before the stages started", file=sys.stderr)
        return 0
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop_signals}
    try:
        engine = Engine(**engine_kwargs)
    except BaseException as exc:
        pending = signal.sigtimedwait(stop_signals, 0) if isinstance(exc, KeyboardInterrupt) else None
        for sig, handler in old.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
        sock.close()
        if pending is not None:  # a stop signal ended the wait for the stages, which are stopped already
            print(f"ringshm: stopped by {signal.Signals(pending.si_signo).name} while the stages loaded; every stage "
                  f"process and segment is gone", file=sys.stderr)
            return 0
        raise
    for sig in stop_signals:  # also what uvicorn re-raises after its graceful shutdown: exit 0 then
        signal.signal(sig, lambda signum, frame: received.append(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)
    if received:
        engine.close()
        return 0
    try:
        if spec is not None:  # a verify chain of spec_depth segments needs that many decode ops in flight
            engine.depth = max(engine.depth, spec_depth)
            if not window_fits_chain(spec_depth):  # more than a row-scaled window is sure to allow: a fixed depth
                engine.rows_per_op = None
        aengine = AsyncEngine(engine, max_waiting=max_waiting, max_queue_wait_s=max_queue_wait_s)
    except BaseException:
        engine.close()
        raise
    died: list[StageDied | DispatcherFailed] = []
    server: list = []

    def on_stage_died(exc: StageDied | DispatcherFailed) -> None:
        died.append(exc)
        server[0].should_exit = True

    served = model_name or model_id_of(engine.model_path)
    app = create_app(aengine, served, spec=spec, spec_k=spec_k,
                     spec_depth=spec_depth, graceful_s=graceful_s, max_body_bytes=max_body_bytes,
                     on_stage_died=on_stage_died, tool_call_parser=tool_call_parser)
    try:
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http,
                                timeout_graceful_shutdown=graceful_s)
        server.append(uvicorn.Server(config))
        # uvicorn handles SIGINT / SIGTERM; SIGHUP asks it for the same graceful exit (it is not re-raised after)
        signal.signal(signal.SIGHUP, lambda signum, frame: server[0].handle_exit(signum, frame))
        if not received:  # one that came while the app was built: uvicorn's handlers were not in place yet
            # the socket listens already (connections queue until uvicorn accepts them); uvicorn names no address
            # for a socket it is handed, so say where, once the stages are up
            at = f"[{host}]" if ":" in host else host
            print(f"ringshm: serving {served} at http://{at}:{sock.getsockname()[1]}/v1 (Ctrl-C stops)",
                  file=sys.stderr, flush=True)
            server[0].run(sockets=[sock])
    finally:
        aengine.close()  # idempotent; covers a failed bind, where the lifespan never ran
    return STAGE_DIED_EXIT if died else 0
