"""Run the simulator for several (workload, policy) pairs in worker processes.

Every simulated run is deterministic given its seed and independent of the others, so the
replay CLI may compute them ahead in parallel (`--sim-workers N`); each SimTarget then
returns its stored result when the runner replays that workload. Workers are forked: they
inherit the targets and requests, and send back records and SpecStats only.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor

from sloserve.replay.records import ReplayRequest
from sloserve.sim.target import SimTarget

_JOBS: list[tuple[SimTarget, list[ReplayRequest]]] = []  # set before forking
# rough relative cost per simulated step (policy work per step), to start the slowest first
_COST_RANK = ("specserve", "goodput", "hf-", "sglang", "lut", "fixed", "ar")


def _rank(policy: str) -> int:
    return next((i for i, p in enumerate(_COST_RANK) if policy.startswith(p)), 3)


def _run_job(i: int):
    target, requests = _JOBS[i]
    records = target.run_sync(requests)
    return records, target.spec_stats()


def prerun(targets: Mapping[str, SimTarget], workloads: Sequence[Sequence[ReplayRequest]],
           workers: int) -> None:
    """Simulate every workload with every target in `workers` processes; store the results
    in the targets (SimTarget.store)."""
    global _JOBS
    by_cost = sorted(targets, key=_rank)  # longest jobs first: the pool finishes together
    _JOBS = [(targets[p], list(reqs)) for reqs in workloads for p in by_cost]
    try:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
            for (target, reqs), (records, stats) in zip(_JOBS, pool.map(_run_job,
                                                                          range(len(_JOBS)))):
                target.store(reqs, records, stats)
    finally:
        _JOBS = []
