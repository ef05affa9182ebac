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


# SGLang 0.5.23 draws its scheduler's torch.distributed port (`nccl_port`) at random from
# 22000-29999, checks it with a bind and binds it for real seconds later
# (sglang/srt/utils/network.py, get_free_port_below_ephemeral): a port drawn here from that
# range could be taken by it in between (CI, 2026-12-04: SGLang's HTTP server failed to bind
# the port behind the front, and its warmup read a TCPStore that never answers for 12 minutes)
SGLANG_PORT_DRAW = (22000, 29999)


def reserve_loopback_port(avoid: frozenset[int] = frozenset()) -> socket.socket:
    """A socket holding a free loopback port (its getsockname()[1]) for a server that binds the
    port later, such as SGLang's behind the front; close it once that server listens (or stops).

    Held, not only checked: every process here draws ports at random (servers started
    together each draw one), and a port that is merely free now can be drawn again before its
    server binds it. The socket is bound without SO_REUSEADDR, so the port's other draws fail
    to bind it (this function's, SGLang's `nccl_port` check), and then given SO_REUSEADDR and
    never listens, so the server's own bind (uvicorn's, asyncio's and uvloop's, all with
    SO_REUSEADDR) succeeds beside it. Drawn outside the kernel's ephemeral range, where a
    health check's connect before the server listens can be handed the port as its own source
    port and read its own request back (CI, 2026-12-02), and outside SGLANG_PORT_DRAW; never
    a port in `avoid` (the front's own --port, which the front binds only later)."""
    import random

    rng = random.SystemRandom()
    ranges = _draw_ranges()
    for _ in range(200):
        lo, hi = rng.choices(ranges, weights=[hi - lo + 1 for lo, hi in ranges])[0]
        port = rng.randint(lo, hi)
        if port in avoid:
            continue
        sock = socket.socket()
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            continue
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock
    raise ListenError("no free loopback port below the kernel's ephemeral range "
                      f"in 200 draws from {ranges}")


def ephemeral_range() -> tuple[int, int]:
    """The ports [first, last] the kernel hands out for bind(0) and connect() (Linux:
    /proc/sys/net/ipv4/ip_local_port_range; its default, 32768-60999, where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = map(int, f.read().split())
    except (OSError, ValueError):
        return 32768, 60999
    return first, last


def _draw_ranges() -> list[tuple[int, int]]:
    """Port ranges [lo, hi] to draw from: 20000 up to just below the kernel's ephemeral range
    (ephemeral_range) less SGLANG_PORT_DRAW, or above the ephemeral range when it starts too
    low to leave a thousand."""
    first, last = ephemeral_range()
    if first - 20000 >= 1000:
        below = [(20000, min(first - 1, SGLANG_PORT_DRAW[0] - 1))]
        if first - 1 > SGLANG_PORT_DRAW[1]:
            below.append((SGLANG_PORT_DRAW[1] + 1, first - 1))
        return below
    if 65535 - last >= 1000:
        return [(last + 1, 65535)]
    return [(20000, SGLANG_PORT_DRAW[0] - 1)]
