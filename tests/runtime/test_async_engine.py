"""The async streaming interface: concurrent streams, validation errors, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from sloserve_testing import prompts_of_lengths

from sloserve.runtime.async_engine import AsyncEngine
from sloserve.runtime.request import InvalidRequest, SamplingParams


def test_streams_match_sync_and_cancel_frees_blocks(make_engine):
    eng = make_engine(spec_policy="fixed:3")
    prompts = prompts_of_lengths([4, 9, 15, 22, 3, 7, 30, 11], seed=21)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [o["output_ids"] for o in eng.generate(prompts, sp)]
    aeng = AsyncEngine(eng)

    async def collect(p):
        ids = []
        async for out in aeng.generate(p, sp):
            ids.extend(out.new_token_ids)
        return ids

    async def cancelled(p):
        n = 0
        async for _ in aeng.generate(p, SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)):
            n += 1
            if n == 3:
                break  # consumer leaves: the request must be aborted
        return n

    async def main():
        got = await asyncio.gather(*(collect(p) for p in prompts), *(cancelled(p) for p in prompts[:4]))
        with pytest.raises(InvalidRequest):
            async for _ in aeng.generate("", sp):
                pass
        return got

    try:
        got = asyncio.run(main())
        assert got[: len(prompts)] == expected
        # wait for the aborts to be processed by the engine thread
        idle = aeng.call(lambda e: (e.has_work, e.scheduler.alloc.num_used)).result(timeout=30)
        assert idle == (False, 0)
    finally:
        aeng.shutdown()
