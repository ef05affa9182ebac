"""Server fixtures: an in-process server over an engine on the tiny pair with fixed
speculation, checked for KV leaks when the module ends."""

from __future__ import annotations

import pytest
from server_testing import start_server, tiny_config

from sloserve.runtime.engine import Engine


@pytest.fixture(scope="module")
def live(tiny_pair):
    """A running server on the tiny pair (speculation fixed:3); after the module, its engine
    must be idle with every KV block free."""
    srv = start_server(Engine(tiny_config(tiny_pair)))
    yield srv
    info = srv.wait_idle()
    srv.stop()
    assert info["kv_pool"]["used_blocks"] == 0, "KV blocks leaked"
    assert not srv.engine.has_work
    srv.engine.check_idle_integrity()


@pytest.fixture
def client(live):
    with live.client() as c:
        yield c
