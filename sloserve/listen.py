"""The server's listening socket, bound before any model loads: a busy port is a one-line
error at once, not a traceback after minutes of loading."""

from __future__ import annotations

import errno
import socket


class ListenError(OSError):
    """The address cannot be listened on; str() is the one-line reason."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR, so a port left
    in TIME_WAIT by a stopped server is fine; one with a live listener is not). port 0 picks
    a free port. Raises ListenError naming the port and host."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ListenError(f"port {port} is in use on {host}") from None
        raise ListenError(f"cannot listen on {host} port {port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def check_free(host: str, port: int) -> None:
    """Raise ListenError unless (host, port) can be listened on now (for servers that bind
    their own socket later, such as SGLang's)."""
    bind(host, port).close()
