"""The async streaming interface: concurrent streams, validation errors, cancellation."""

from __future__ import annotations

import asyncio
import time

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


@pytest.mark.parametrize("when", ["before_taken", "while_adding"])
def test_caller_leaving_before_the_engine_takes_the_request(make_engine, when):
    """A caller cancelled between submitting and the engine taking the request (an HTTP
    client that disconnects at once) must not kill the engine thread, and the request must
    not run on with no one listening."""
    import threading

    eng = make_engine(spec_policy="ar")
    aeng = AsyncEngine(eng)
    gate, entered = threading.Event(), threading.Event()

    def hold(e):  # keeps the engine thread busy between steps
        entered.set()
        gate.wait(10)

    if when == "while_adding":  # the add is taken, then the caller leaves before the reply
        real_add = eng.add_request

        def slow_add(*args, **kwargs):
            req = real_add(*args, **kwargs)
            entered.set()
            gate.wait(10)
            return req

        eng.add_request = slow_add
    sp = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)

    async def main():
        if when == "before_taken":
            aeng.call(hold)
            await asyncio.to_thread(entered.wait, 10)
        task = asyncio.create_task(_drain(aeng.generate([5, 6, 7], sp)))
        if when == "while_adding":
            await asyncio.to_thread(entered.wait, 10)
        else:
            await asyncio.sleep(0.05)  # the add is queued behind `hold`
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()

    try:
        asyncio.run(main())
        # the abort reaches the engine thread right after the add completes, which can be
        # after this check was queued: poll (the request must go, not necessarily at once)
        assert _idle_soon(aeng)
        # gone by abort (or never added), not by running its 500 tokens to the end
        assert eng.stats.requests_finished == eng.stats.requests_aborted
        # and it still serves
        out = asyncio.run(_drain(aeng.generate([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))))
        assert out == 4
    finally:
        gate.set()
        aeng.shutdown()


def test_caller_loop_closing_mid_stream_aborts_its_request(make_engine):
    """A caller whose event loop closes while its request still streams (a worker thread's
    asyncio.run ending without closing the stream) must not stop the engine: its request is
    aborted, its KV blocks return, and the others keep being served."""
    eng = make_engine(spec_policy="ar")
    aeng = AsyncEngine(eng)
    sp = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)
    try:
        loop = asyncio.new_event_loop()
        stream = aeng.generate([5, 6, 7], sp)
        first = loop.run_until_complete(stream.__anext__())
        assert not first.finished
        loop.close()  # the stream is left open: the engine's next output meets a closed loop
        assert _idle_soon(aeng)
        assert eng.stats.requests_aborted == 1 and eng.stats.requests_finished == 1
        out = asyncio.run(_drain(aeng.generate([5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))))
        assert out == 4
    finally:
        aeng.shutdown()


def _idle_soon(aeng: AsyncEngine, tries: int = 200) -> bool:
    """Polls until the engine has no work and no KV block in use; then whether it is alive."""
    for _ in range(tries):
        state = aeng.call(lambda e: (e.has_work, e.scheduler.alloc.num_used)).result(timeout=30)
        if state == (False, 0):
            return aeng.alive
        time.sleep(0.02)
    return False


async def _drain(stream) -> int:
    n = 0
    async for out in stream:
        n += len(out.new_token_ids)
    return n
