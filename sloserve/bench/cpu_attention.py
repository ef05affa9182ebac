"""The CPU sgl_kernel stand-in's attention per forward: a decode step against a ragged verify
(short extends of 1..k_max + 1 rows a request), with the per-forward plans
(`attention._PlanMemo`) and with them rebuilt in every layer, as before 2026-11-29.
SmolLM2-135M's shapes (30 layers, 9 query heads over 3 KV heads of 64) by default; about a
minute on a 2-core CPU. The two variants take turns (the order reversed every repeat), so a
machine whose speed drifts moves both alike.

    python -m sloserve.bench.cpu_attention [--repeats 30] [--out out/bench_cpu_attention.json]

Prints a table (milliseconds per forward, medians over the repeats) and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.sglang_cpu.cpu_ops import attention

# (batch, context tokens before the step per request, rows a request verifies: 1 = none)
CASES = (
    (4, [150, 180, 210, 160], [1, 5, 1, 9]),
    (16, [150 + 7 * i for i in range(16)], [1, 5, 1, 9, 1, 1, 3, 1, 1, 4, 1, 1, 9, 1, 2, 1]),
)


class _Rebuilt(attention._PlanMemo):
    """The plans rebuilt at every call (every layer), as the stand-in did before."""

    def get(self, meta, req_to_token, pool_idx, parts, build):  # type: ignore[no-untyped-def]
        return build()


def forwards(layers: int, heads: int, kv_heads: int, head_dim: int, batch: int,
             context: list[int], verify: list[int],
             pool: int = 50_000) -> dict[str, Callable[[], None]]:
    """One forward's attention calls (every layer) of a decode step and of a ragged verify
    over random KV in a pool of `pool` slots (38 MB a buffer in float32), SGLang's layout (req_to_token rows as long as
    SmolLM2's context)."""
    g = torch.Generator().manual_seed(0)
    kb = [torch.randn(pool, kv_heads, head_dim, generator=g) for _ in range(layers)]
    vb = [torch.randn(pool, kv_heads, head_dim, generator=g) for _ in range(layers)]
    width = max(context) + max(verify) + 1
    table = torch.zeros(4 * batch, 8192 + 64, dtype=torch.int32)
    table[:, :width] = (torch.randperm(pool - 1, generator=g)[: 4 * batch * width]
                        .view(4 * batch, width) + 1).int()
    rpi = torch.arange(batch) * 3 + 1  # [bs] pool rows
    ext = torch.tensor(verify)  # [bs] rows of the verify
    lens = torch.tensor(context) + ext  # [bs] after the verify
    starts = torch.cumsum(ext, 0) - ext  # [bs]
    T = int(ext.sum())
    q, o = torch.randn(T, heads, head_dim, generator=g), torch.empty(T, heads, head_dim)
    k, v = (torch.randn(T, kv_heads, head_dim, generator=g) for _ in range(2))
    qd, od = torch.randn(batch, heads, head_dim, generator=g), torch.empty(batch, heads, head_dim)
    kd, vd = (torch.randn(batch, kv_heads, head_dim, generator=g) for _ in range(2))
    dlens = lens - ext + 1  # [bs] a decode step's lengths
    loc = table[rpi, dlens - 1].long()  # [bs] its new tokens' slots

    def decode() -> None:
        for layer in range(layers):
            attention.decode_attention(qd, kb[layer], vb[layer], 1.0, 1.0, od, kd, vd, loc,
                                       torch.empty(0), table, rpi, dlens, head_dim ** -0.5, 0.0)

    def verify_forward() -> None:
        for layer in range(layers):
            attention.extend_attention(q, k, v, o, kb[layer], vb[layer], 1.0, 1.0, table, rpi,
                                       lens, ext, starts, int(ext.max()), head_dim ** -0.5, 0.0)

    return {"decode": decode, "verify": verify_forward}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sloserve.bench.cpu_attention",
                                description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--out", default="out/bench_cpu_attention.json")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.layers < 1:
        p.error("--repeats and --layers must be at least 1")
    print(f"about {10 + args.repeats * args.layers / 30:.0f} s on a 2-core CPU", flush=True)
    memos = {"per forward": attention._MEMO, "per layer": _Rebuilt()}
    rows, results = [], []
    for batch, context, verify in CASES:
        fns = forwards(args.layers, 9, 3, 64, batch, context, verify)
        ms: dict[tuple[str, str], list[float]] = {(m, f): [] for m in memos for f in fns}
        with torch.inference_mode():
            for rep in range(args.repeats + 1):  # the first: warm-up, not counted
                for m in (list(memos) if rep % 2 else list(memos)[::-1]):
                    attention._MEMO = memos[m]
                    try:
                        for f, fn in fns.items():
                            t = time.perf_counter()
                            fn()
                            if rep:
                                ms[(m, f)].append(1e3 * (time.perf_counter() - t))
                    finally:
                        attention._MEMO = memos["per forward"]
        med = {key: statistics.median(v) for key, v in ms.items()}
        for f in fns:
            ratio = med[("per forward", f)] / med[("per layer", f)]
            rows.append([batch, sum(verify), f, f"{med[('per layer', f)]:.1f}",
                         f"{med[('per forward', f)]:.1f}", f"{ratio:.2f}"])
            results.append({"batch": batch, "rows": sum(verify), "forward": f,
                            "per_layer_ms": med[("per layer", f)],
                            "per_forward_ms": med[("per forward", f)],
                            "samples": {m: ms[(m, f)] for m in memos}})
    print_table(["batch", "query rows", "forward", "plans per layer ms",
                 "plans per forward ms", "ratio"], rows)
    write_json(args.out, {"machine": machine_info(), "layers": args.layers,
                          "repeats": args.repeats, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
