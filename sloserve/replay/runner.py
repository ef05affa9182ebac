"""Run one workload against several policies' targets, one policy after the other."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from tqdm import tqdm

from sloserve.replay.records import PolicyRun, ReplayRequest, RequestRecord
from sloserve.replay.targets import Target


def run_policies(
    requests: Sequence[ReplayRequest],
    targets: Mapping[str, Target],
    show_progress: bool = True,
) -> list[PolicyRun]:
    """Replay `requests` against each policy's target in turn (never concurrently, so runs
    do not share the machine) and collect the records and engine stats."""
    runs = []
    for policy, target in targets.items():
        bar = tqdm(total=len(requests), desc=policy, unit="req", disable=not show_progress)
        failures = 0

        def progress(record: RequestRecord, bar: tqdm = bar) -> None:
            nonlocal failures
            failures += not record.success
            bar.update(1)
            if failures:
                bar.set_postfix(failed=failures)

        try:
            records = asyncio.run(target.run(list(requests), progress))
        finally:
            bar.close()
        runs.append(PolicyRun(policy, tuple(records), target.spec_stats()))
    return runs
