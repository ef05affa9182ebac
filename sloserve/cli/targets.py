"""The target factory of the replay command line, the sweep driver and the fidelity check:
a `Target` (replay/targets.py) by kind, "http", "inprocess" or "sim". It lives on the top
floor because the "sim" kind imports the simulator, which imports replay's records and
traces."""

from __future__ import annotations

from sloserve.replay.targets import Target

TARGET_KINDS = ("http", "inprocess", "sim")


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
