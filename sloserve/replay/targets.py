"""Targets: whatever replays a list of requests and measures them.

A target sends each `ReplayRequest` at its arrival time (open loop: arrivals never wait for
earlier responses), streams the output and returns one `RequestRecord` per request, in the
order of the input list. Kinds:

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

TARGET_KINDS = ("http", "inprocess", "sim")



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


def make_target(
    kind: str,
    policy: str,
    *,
    url: str | None = None,
    temperature: float = 0.0,
    timeout_s: float | None = None,
    max_concurrency: int | None = None,
    engine_config=None,
    profile: str | None = None,
    acceptance: str | None = None,
    sim_seed: int = 0,
    max_context: int | None = None,
) -> Target:
    """Build the target that replays with `policy`.

    http: `url` is the server's base URL (the server must be running `policy`).
    inprocess: `engine_config` (an EngineConfig; its spec_policy is replaced by `policy`).
    sim: `engine_config` as for inprocess, `profile` (a cost profile file, required),
    `acceptance` (an acceptance file; default the built-in pair's), `sim_seed`,
    `max_context` (the simulated target's context window; None = unlimited).
    """
    if kind == "http":
        from sloserve.replay.http_target import SGLangHTTPTarget

        if not url:
            raise ValueError(f"the http target needs a URL (policy {policy!r})")
        return SGLangHTTPTarget(
            url, temperature=temperature, timeout_s=timeout_s, max_concurrency=max_concurrency
        )
    if kind == "inprocess":
        import dataclasses

        from sloserve.replay.inprocess_target import InProcessTarget
        from sloserve.runtime.config import EngineConfig

        cfg = dataclasses.replace(engine_config or EngineConfig(), spec_policy=policy)
        return InProcessTarget(cfg, temperature=temperature, timeout_s=timeout_s)
    if kind == "sim":
        import dataclasses

        from sloserve.runtime.config import EngineConfig
        from sloserve.sim.target import make_sim_target

        if not profile:
            raise ValueError(f"the sim target needs a cost profile (--profile) (policy {policy!r})")
        cfg = dataclasses.replace(engine_config or EngineConfig(), spec_policy=policy)
        return make_sim_target(cfg, profile, acceptance, seed=sim_seed, max_context=max_context)
    raise ValueError(f"unknown target kind {kind!r}; expected one of {TARGET_KINDS}")
