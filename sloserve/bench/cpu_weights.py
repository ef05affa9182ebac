"""A forward's linear layers and LM head on the CPU with SGLang's row-major float32 weights
against the column-major and oneDNN-packed ones sloserve's SGLang plugin uses (sloserve/
sglang_ext/cpu_weights.py), for 1..32 rows (a decode step of batch B has B rows, a verify B (k + 1)).
SmolLM2-135M's shapes by default (30 layers of qkv 960 x 576, o 576 x 576, gate_up
3072 x 576, down 576 x 1536, and the 49,152 x 576 head: 540 MB of random weights, so every
forward streams them from memory as the model's does). Two to four minutes on a 2-core CPU.
The layouts take turns (the order reversed every repeat), so a drifting machine moves both
alike.

    python -m sloserve.bench.cpu_weights [--rows 1,2,3,4,6,8,12,16,24,32] [--repeats 7]
        [--threads 2] [--out out/bench_cpu_weights.json]

With --bf16 it measures the SPECSERVE draft's bf16 products instead (cpu_weights.Bf16Linear:
the input cast to bf16, the product cast back), F.linear on the row-major bf16 weight
against oneDNN's packed copy: 4 layers and the 16,384-row hot head by default (the
distilled SmolLM2 draft's), under a second on a 2-core CPU.

Prints a table (milliseconds per forward's products, medians over the repeats) and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.runtime.models.cpu_linear import pack_weight, packed_linear, packed_linear_available
from sloserve.sglang_ext.cpu_weights import column_major

# SmolLM2-135M: one layer's (out, in) products (q/k/v fused, gate/up fused) and the head
LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
HEAD = (49_152, 576)


def weights(layers: int, seed: int = 0, head_rows: int = HEAD[0],
            dtype: torch.dtype = torch.float32
            ) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    stack = [[(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for n, k in LAYER]
             for _ in range(layers)]
    return stack, (torch.randn(head_rows, HEAD[1], generator=g) / HEAD[1] ** 0.5).to(dtype)


def _bf16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(torch.bfloat16), w).float()


def _bf16_packed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return packed_linear(x.to(torch.bfloat16), w).float()


def products(x: torch.Tensor, stack: list[list[torch.Tensor]], head: torch.Tensor,
             mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
             ) -> torch.Tensor:
    """The forward's linear products as SGLang computes them: F.linear per layer (the
    down projection's input is the gate/up product's first half), hidden @ head.T; mm
    (packed_linear for packed weights) replaces both where given."""
    for qkv, o, gate_up, down in stack:
        lin = mm or F.linear
        lin(x, qkv)
        lin(x, o)
        h = lin(x, gate_up)
        lin(h[:, : down.shape[1]].contiguous(), down)
    return mm(x, head) if mm is not None else x @ head.T


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sloserve.bench.cpu_weights",
                                description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32")
    p.add_argument("--layers", type=int, default=None,
                   help="default: 30 (the target), 4 with --bf16 (the draft)")
    p.add_argument("--head-rows", type=int, default=None,
                   help="default: 49,152 (the whole head), 16,384 with --bf16 (the hot one)")
    p.add_argument("--bf16", action="store_true",
                   help="the draft's bf16 products: F.linear against oneDNN's packed copy")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/bench_cpu_weights.json")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"argument --rows: not a comma-separated list of integers: {args.rows!r}")
    if not rows or min(rows) < 1:
        p.error("argument --rows: every row count must be >= 1")
    if args.layers is None:
        args.layers = 4 if args.bf16 else 30
    if args.head_rows is None:
        args.head_rows = 16_384 if args.bf16 else HEAD[0]
    if args.repeats < 1 or args.layers < 1 or args.threads < 1 or args.head_rows < 1:
        p.error("arguments --repeats, --layers, --head-rows and --threads must be >= 1")
    if args.bf16 and not packed_linear_available(torch.bfloat16):
        p.error("argument --bf16: this torch on this CPU has no oneDNN packed bf16 linear to "
                "compare with (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    print(f"{dtype} linear products of {args.layers} SmolLM2-shaped layers and a "
          f"{args.head_rows}-row head, "
          + ("F.linear against oneDNN-packed bf16 weights" if args.bf16 else
             "row-major against column-major and oneDNN-packed weights")
          + f", {len(rows)} row counts x {args.repeats} repeats; "
          + ("seconds" if args.bf16 else "2-4 minutes") + " on a 2-core CPU", flush=True)
    stack, head = weights(args.layers, head_rows=args.head_rows, dtype=dtype)
    layouts: dict[str, tuple[list[list[torch.Tensor]], torch.Tensor, Callable | None]]
    if args.bf16:
        layouts = {"row": (stack, head, _bf16_linear)}
    else:
        layouts = {"row": (stack, head, None),
                   "column": ([[column_major(w) for w in ws] for ws in stack],
                              column_major(head), None)}
    if packed_linear_available(dtype):
        layouts["packed"] = ([[pack_weight(w) for w in ws] for ws in stack], pack_weight(head),
                             _bf16_packed if args.bf16 else packed_linear)
    table, results = [], []
    for m in rows:
        x = torch.randn(m, HEAD[1], generator=torch.Generator().manual_seed(m))
        times: dict[str, list[float]] = {name: [] for name in layouts}
        for s, h, mm in layouts.values():  # warm-up
            products(x, s, h, mm)
        for rep in range(args.repeats):
            order = list(layouts) if rep % 2 == 0 else list(layouts)[::-1]
            for name in order:
                s, h, mm = layouts[name]
                t0 = time.perf_counter()
                products(x, s, h, mm)
                times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        results.append({"rows": m, "ms": med, "all_ms": {n: [t * 1e3 for t in v]
                                                         for n, v in times.items()}})
        table.append([m, *(f"{med[n]:.1f}" for n in layouts),
                      *(f"{med[n] / med['row']:.2f}" for n in layouts if n != "row")])
        print(f"  {m} rows done", flush=True)
    print_table(["rows", *(f"{n} ms" for n in layouts),
                 *(f"{n} / row" for n in layouts if n != "row")], table)
    write_json(args.out, {"machine": machine_info(), "args": vars(args),
                          "torch": torch.__version__, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
