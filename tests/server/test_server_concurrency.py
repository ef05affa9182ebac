"""Acceptance 2: 64 concurrent streaming requests all complete with the right token counts,
and greedy outputs over HTTP equal the in-process engine's greedy outputs."""

from __future__ import annotations

import asyncio
import json

import httpx
from server_testing import tiny_config
from sloserve_testing import prompts_of_lengths

from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams

N = 64


async def _stream(client: httpx.AsyncClient, ids: list[int], n: int) -> dict:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    last, done, chunks = None, False, 0
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                else:
                    last = json.loads(data)
                    chunks += 1
    return {"last": last, "done": done, "chunks": chunks}


def test_64_concurrent_streams_match_in_process_greedy(live, tiny_pair):
    lengths = [3 + (7 * i) % 40 for i in range(N)]
    max_new = [4 + (5 * i) % 21 for i in range(N)]
    prompts = prompts_of_lengths(lengths, seed=64)

    async def main():
        limits = httpx.Limits(max_connections=N + 4)
        async with httpx.AsyncClient(base_url=live.url, timeout=httpx.Timeout(120.0),
                                     limits=limits) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(_stream(c, p, n) for p, n in zip(prompts, max_new))), 120)

    results = asyncio.run(main())
    ref_engine = Engine(tiny_config(tiny_pair))
    ref = ref_engine.generate(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0,
                                                       ignore_eos=True) for n in max_new])
    for res, n, want in zip(results, max_new, ref):
        last = res["last"]
        assert res["done"] and last["meta_info"]["finish_reason"] == {"type": "length",
                                                                      "length": n}
        assert last["meta_info"]["completion_tokens"] == len(last["output_ids"]) == n
        assert last["output_ids"] == want["output_ids"]
        assert last["text"] == want["text"]
    assert sum(r["chunks"] for r in results) > N  # streamed, not one chunk per request
    info = live.wait_idle()
    assert info["kv_pool"]["used_blocks"] == 0
