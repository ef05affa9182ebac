"""Loopback ports for servers that bind them later (SGLang behind the front, test servers):
drawn outside the kernel's ephemeral range and SGLang's own draws, and held until the server
binds them, so that servers started together never get one port (CI, 2026-11-27 and
2026-12-04: a SGLang server that failed to bind its port and never answered)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sloserve import listen
from sloserve.listen import SGLANG_PORT_DRAW, ListenError, ephemeral_range, reserve_loopback_port


def test_a_held_port_is_refused_to_every_other_draw_and_taken_by_its_server():
    held = [reserve_loopback_port() for _ in range(20)]
    try:
        ports = [s.getsockname()[1] for s in held]
        assert len(set(ports)) == 20
        first, last = ephemeral_range()
        for p in ports:
            assert not SGLANG_PORT_DRAW[0] <= p <= SGLANG_PORT_DRAW[1]
            assert not first <= p <= last
        port = ports[0]
        # a draw's check binds without SO_REUSEADDR (ours, SGLang's nccl_port): refused, on
        # the loopback address and on every address
        for host in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as other, pytest.raises(OSError):
                other.bind((host, port))

        # the server's own bind (SO_REUSEADDR, as uvicorn's) succeeds beside the reservation
        async def serve_once() -> bytes:
            async def answer(reader, writer):
                writer.write(b"ok")
                await writer.drain()
                writer.close()

            server = await asyncio.start_server(answer, "127.0.0.1", port)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            got = await reader.read(2)
            writer.close()
            server.close()
            await server.wait_closed()
            return got

        assert asyncio.run(serve_once()) == b"ok"
    finally:
        for s in held:
            s.close()


def _two_free_ports() -> int:
    """lo, with lo and lo + 1 both free now."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            lo = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", lo + 1))
            except OSError:
                continue
            return lo
    pytest.skip("no two adjacent free ports")


def test_the_front_port_is_never_drawn_for_the_server_behind_it(monkeypatch):
    """`avoid`: the front's --port, bound only after SGLang's port is drawn."""
    lo = _two_free_ports()
    monkeypatch.setattr(listen, "_draw_ranges", lambda: [(lo, lo + 1)])
    for _ in range(10):
        with reserve_loopback_port(avoid=frozenset({lo})) as s:
            assert s.getsockname()[1] == lo + 1
    with pytest.raises(ListenError, match="no free loopback port"):
        reserve_loopback_port(avoid=frozenset({lo, lo + 1}))


def test_draw_ranges_leave_out_sglangs_draws_and_the_ephemeral_range():
    first, last = ephemeral_range()
    for lo, hi in listen._draw_ranges():
        assert lo <= hi
        assert hi < SGLANG_PORT_DRAW[0] or lo > SGLANG_PORT_DRAW[1]
        assert hi < first or lo > last
