"""Fixtures of the replay tests: the shared data directory and a fake SGLang SSE server."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture
def data_dir() -> Path:
    """../shared/data relative to the repo root; skips the test when it is absent."""
    if not DATA_DIR.is_dir():
        pytest.skip(f"shared data not found at {DATA_DIR}")
    return DATA_DIR


@dataclass
class FakeSGLang:
    """A minimal HTTP/1.1 server speaking SGLang's streaming /generate protocol.

    Each request streams ceil(max_new_tokens / tokens_per_chunk) chunks: the first after
    ttft_s, the others itl_s apart, `text` cumulative, then a repeated final chunk (no new
    token) and `data: [DONE]`. Prompts "fail500" and "errorchunk" trigger failures.
    """

    ttft_s: float = 0.05
    itl_s: float = 0.01
    tokens_per_chunk: int = 2
    received: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    url: str = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        headers = {
            name.lower(): value
            for name, value in (line.split(": ", 1)
                                for line in head.decode().split("\r\n")[1:] if ": " in line)
        }
        body = json.loads(await reader.readexactly(int(headers["content-length"])))
        self.received.append((time.perf_counter(), body))
        if body.get("text") == "fail500":
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n"
                         b"Connection: close\r\n\r\nboom")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            await self._stream(body, writer)
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def _stream(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        def send(obj: Any) -> None:
            data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        if body.get("text") == "errorchunk":
            send({"error": {"message": "out of memory"}})
            return
        n = body["sampling_params"]["max_new_tokens"]
        prompt_len = len(body["input_ids"]) if "input_ids" in body else len(body["text"].split())
        await asyncio.sleep(self.ttft_s)
        count = 0
        chunk: dict[str, Any] = {}
        while count < n:
            count = min(n, count + self.tokens_per_chunk)
            chunk = {"text": "x" * count, "meta_info": {
                "prompt_tokens": prompt_len, "completion_tokens": count}}
            send(chunk)
            await writer.drain()
            if count < n:
                await asyncio.sleep(self.itl_s)
        send(chunk)  # a final chunk without new tokens (finish_reason), like SGLang
        send("[DONE]")


@pytest.fixture
def fake_sglang() -> Iterator[FakeSGLang]:
    """A FakeSGLang listening on 127.0.0.1 (own event loop in a thread); `.url` is its base."""
    fake = FakeSGLang()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    server_box: list[asyncio.base_events.Server] = []

    async def start() -> None:
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        server_box.append(server)
        fake.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop)
    assert ready.wait(5), "fake server did not start"
    try:
        yield fake
    finally:
        server_box[0].close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
