"""Targets: whatever replays a list of requests and measures them.

A target sends each `ReplayRequest` at its arrival time (open loop: arrivals never wait for
earlier responses), streams the output and returns one `RequestRecord` per request, in the
order of the input list. The kinds (built by cli/targets.py `make_target`, which
imports the simulator: the simulator imports replay's records and traces):

- "http": a server speaking SGLang's native `/generate` streaming protocol (http_target.py).
  The server runs one speculation policy; the policy name only labels the results, so each
  policy needs its own server (URL).
- "inprocess": the sloserve engine in this process (inprocess_target.py); one model pair is
  loaded and shared, each policy gets its own engine and policy object.
- "sim": the event-clock simulator (sloserve/sim): the engine's scheduler and policies with
  forwards priced by a cost profile and acceptance drawn from a stochastic model.
"""

from __future__ import annotations

from typing import Protocol

from sloserve.replay.records import Progress, ReplayRequest, RequestRecord, SpecStats


class Target(Protocol):
    """Replays requests against a serving system."""

    async def run(
        self, requests: list[ReplayRequest], progress: Progress | None
    ) -> list[RequestRecord]:
        """Send every request at its arrival_s after the run start; one record per request,
        in input order, with times in seconds since the run start."""
        ...

    def spec_stats(self) -> SpecStats | None:
        """Engine-side speculation counters of the last run, if the target can see them."""
        ...
