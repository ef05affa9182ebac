"""Asynchronous streaming interface over the engine, for the HTTP server.

One background thread owns the engine and runs its step loop; nothing else touches it.
Callers submit commands through a queue and receive each request's outputs on an asyncio
queue. Invalid requests raise in the caller (before any streaming); a consumer that stops
early (client disconnect) aborts its request, which frees its KV blocks.

Work of one request inside a step that raises (its sampling rows, its grammar, its
log-probabilities) fails only that request (RequestFailed; step.py isolates it), and its
co-batched requests go on with the output they would have had alone. A step that raises as a
whole (the forward pass, drafting) fails only its batch: the running requests get StepFailed,
their KV blocks go back to the pool, and the loop goes on with the waiting ones. The engine stops
(every request gets EngineDeadError, `alive` turns False) only when the KV pool is
inconsistent after such a failure, when MAX_CONSECUTIVE_STEP_FAILURES steps fail in a row,
or when anything outside a step fails.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from sloserve.runtime.cpu_tuning import release_openmp_workers
from sloserve.runtime.engine import Engine, RequestOutput
from sloserve.runtime.request import SamplingParams

log = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """The engine could not finish a request (not the request's fault)."""


class EngineDeadError(EngineFailure):
    """The engine thread has stopped: nothing can be served until a restart."""


class StepFailed(EngineFailure):
    """The engine step that ran this request raised; the request was dropped and the engine
    went on with the others."""


class RequestFailed(EngineFailure):
    """The engine's work for this request alone raised (its sampling rows, its grammar): it
    ended this request, the rest of its batch went on."""


MAX_CONSECUTIVE_STEP_FAILURES = 8  # then the engine is broken, not one batch: it stops


@dataclass
class _Add:
    prompt: str | Sequence[int]
    params: SamplingParams
    rid: str | None
    sink: Callable[[object], bool]  # an output or an exception; False: the caller is gone
    done: Future


def _loop_sink(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[object], bool]:
    """A sink that hands outputs to the caller's event loop. It returns False once that loop
    is closed (the caller is gone for good): its request is then aborted, and the engine
    thread must never fail on it."""

    def sink(out: object) -> bool:
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # "Event loop is closed"
            return False
        return True

    return sink


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._sinks: dict[str, Callable[[object], bool]] = {}
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self.failed_steps = 0  # steps that raised and were recovered from
        self._consecutive_failures = 0
        self._thread = threading.Thread(target=self._loop, name="sloserve-engine", daemon=True)
        release_openmp_workers()  # the engine thread's OpenMP pool must be the only one
        self._thread.start()

    # ----- public API (any thread / the event loop)
    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, rid: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request; yields its outputs step by step until it finishes.
        Raises InvalidRequest before the first yield when the request is bad."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        done: Future = Future()
        self._submit(_Add(prompt, params, rid, _loop_sink(loop, q), done))
        try:
            added: str = await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the caller left before the engine took the request
            done.add_done_callback(self._abort_when_added)
            raise
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(added)

    def _abort_when_added(self, done: Future) -> None:
        if not done.cancelled() and done.exception() is None and self._error is None:
            self.abort(done.result())

    def abort(self, rid: str) -> None:
        self._submit(("abort", rid))

    def call(self, fn: Callable[[Engine], object]) -> Future:
        """Run fn(engine) on the engine thread (between steps); returns a Future."""
        fut: Future = Future()
        self._submit(("call", fn, fut))
        return fut

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    # ----- engine thread
    def _submit(self, cmd) -> None:
        if self._error is not None:
            raise EngineDeadError(f"engine stopped after an error: {self._error}")
        self._cmds.put(cmd)

    def _handle(self, cmd) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            if not cmd.done.set_running_or_notify_cancel():  # its caller already left
                return
            try:
                req = eng.add_request(cmd.prompt, cmd.params, cmd.rid)
            except Exception as e:  # InvalidRequest and friends go back to the caller
                cmd.done.set_exception(e)
                return
            self._sinks[req.rid] = cmd.sink
            cmd.done.set_result(req.rid)
        elif cmd[0] == "abort":
            eng.abort(cmd[1])
            self._dispatch(eng.take_aborted())
        elif cmd[0] == "call":
            try:
                cmd[2].set_result(cmd[1](eng))
            except Exception as e:
                cmd[2].set_exception(e)
            self._dispatch(eng.take_aborted())  # fn may have aborted requests

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        orphaned = False
        for o in outs:
            sink = self._sinks.pop(o.rid, None) if o.finished else self._sinks.get(o.rid)
            if sink is not None and o.error is not None:
                sink(RequestFailed(f"the engine could not continue this request ({o.error}); "
                                   "it alone was ended, the server goes on"))
            elif sink is not None and not sink(o) and not o.finished:
                self._sinks.pop(o.rid, None)  # nobody listens any more: free its KV now
                orphaned = self.engine.abort(o.rid) or orphaned
        if orphaned:  # their abort outputs (finished, so this recursion ends) find no sink
            self._dispatch(self.engine.take_aborted())

    def _loop(self) -> None:
        eng = self.engine
        if eng.cfg.num_threads:  # OpenMP's thread count is per thread: set it here too
            torch.set_num_threads(eng.cfg.num_threads)
        while not self._stop.is_set():
            try:
                block = not eng.has_work
                while True:
                    try:
                        cmd = self._cmds.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    block = False
                    self._handle(cmd)
                if eng.has_work:
                    try:
                        outs = eng.step()
                    except Exception as e:
                        self._recover(e)
                    else:
                        self._consecutive_failures = 0
                        self._dispatch(outs)
            except BaseException as e:  # outside a step, or recovery failed: stop loudly
                log.exception("engine loop failed; the engine stops")
                self._error = e
                for sink in self._sinks.values():
                    sink(EngineDeadError(f"engine failed: {e}"))
                self._sinks.clear()
                return

    def _recover(self, error: Exception) -> None:
        """A step raised: fail its batch, keep the rest. Raises when that is not safe."""
        log.exception("engine step failed; failing its requests")
        self._consecutive_failures += 1
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self._consecutive_failures} engine steps failed in a row, "
                               f"the last with: {error!r}") from error
        dropped = self.engine.drop_failed_step()  # raises if the KV pool is inconsistent
        self.failed_steps += 1
        for rid in dropped:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink(StepFailed(f"the engine step running this request failed ({error!r:.200}); "
                                "the request was dropped, the server goes on"))
        self._dispatch(self.engine.take_aborted())  # the dropped ones find no sink now
        log.warning("dropped %d requests of the failed step; %d waiting go on",
                    len(dropped), len(self.engine.scheduler.waiting))
