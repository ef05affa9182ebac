"""Continuous batching: FCFS admission, a per-step token budget, chunked prefill mixed with
decodes, and preemption by recompute when KV blocks run out.

The scheduler decides which requests run this step and makes sure each has KV blocks for the
tokens it may write (a decode reserves `lookahead` extra slots for draft/verify tokens). It
never runs models; the engine executes what it returns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sloserve.runtime.kv_cache import BlockAllocator
from sloserve.runtime.request import Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    max_step_tokens: int = 2048  # target query tokens per step: decodes count 1, prefill chunks
    # their length
    chunked_prefill: bool = True
    max_queued_requests: int | None = None  # most waiting requests; None: no limit


@dataclass
class Schedule:
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator):
        self.cfg = cfg
        self.alloc = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.alloc.free(req.blocks)
        req.blocks = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Ensure req has blocks for `num_tokens` KV positions."""
        need = self.alloc.blocks_for(num_tokens) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.alloc.num_free:
            return False
        req.blocks.extend(self.alloc.allocate(need))
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free blocks beyond the first `num_tokens` KV positions (rollback)."""
        keep = self.alloc.blocks_for(num_tokens)
        if len(req.blocks) > keep:
            self.alloc.free(req.blocks[keep:])
            del req.blocks[keep:]

    def _preempt(self, req: Request, out: Schedule) -> None:
        self.running.remove(req)
        self.alloc.free(req.blocks)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def schedule(self, lookahead: int = 0) -> Schedule:
        out = Schedule()
        budget = self.cfg.max_step_tokens
        # 1. running requests in arrival order; when blocks run out, the newest running
        # request is preempted (recompute) until the older ones fit.
        i = 0
        while i < len(self.running):
            req = self.running[i]
            decoding = req.pending_len == 1
            chunk = 1 if decoding else min(req.pending_len, budget)
            if not decoding and (chunk <= 0 or (chunk < req.pending_len and not self.cfg.chunked_prefill)):
                i += 1
                continue
            need = req.kv_len + chunk + (lookahead if decoding else 0)
            while not self._grow(req, need):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                break  # req itself was preempted; everything after it too
            if decoding:
                out.decodes.append(req)
            else:
                out.prefills.append((req, chunk))
            budget -= chunk
            i += 1
        # 2. admit waiting requests FCFS while they fit
        while self.waiting and len(self.running) < self.cfg.max_running_requests and budget > 0:
            req = self.waiting[0]
            chunk = min(req.pending_len, budget)
            if chunk < req.pending_len and not self.cfg.chunked_prefill:
                break
            if not self._grow(req, req.kv_len + chunk):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.prefills.append((req, chunk))
            budget -= chunk
        return out
