"""The server's listening socket, bound before anything heavy loads: a port in use or out of range is the
user's to fix, so ``ringshm serve`` says so in under a second (exit 2) instead of after loading the model.
No torch, no uvicorn here."""

from __future__ import annotations

import errno
import socket

BACKLOG = 2048  # uvicorn's default backlog


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (what uvicorn would bind; hand it to
    ``uvicorn.Server.run(sockets=[...])``). Connections that arrive while the model loads wait in the backlog.

    Raises:
        ValueError: ``port`` outside 1-65535, ``host`` that does not resolve, the address in use or not one of
            this machine's; the message names the flag to change.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"--port {port!r} is outside 1-65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host!r} does not resolve: {getattr(exc, 'strerror', None) or exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: {host}:{port} is already in use (stop what listens there, or pick "
                             f"another --port)") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror} (check --host / --port)") from None
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock
