"""JSON-schema generation speed with and without speculation (issue #19, acceptance 3): the
built-in pair, every policy side by side at batch 1 and 8 in one run. Takes about 4 minutes
on a 2-core CPU with the defaults, 8-9 with --plain.

    python -m sloserve.bench.structured [--policies ar,fixed:3,specserve] [--batches 1,8]
        [--temperature 0] [--repeats 3] [--out out/bench_structured.json]

Every request asks for a document of SCHEMA (json_schema, compiled with xgrammar; the compact
layout unless --any-whitespace) after an ordinary prompt cut to --prompt-tokens, with a budget
of --max-new-tokens; the grammar ends it (the model's EOS once the document is complete). The
closed loop of bench/spec.py: b requests in flight, the next submitted when one finishes,
until each policy has finished max(b * 2, --min-requests) requests; the engines (shared
weights, their own KV pools) take one step each in turn so all are measured over the same
stretch of time. tok/s = generated tokens / the engine's own clock; TPOT per finished
request. Repeated --repeats times (the order rotates), medians reported; "vs ar" is the
median over repeats of tok/s / ar's tok/s in the same repeat. "valid" counts the finished
documents that parse and validate against SCHEMA. --plain adds the same loop without the
schema (ignore_eos, the same lengths as the schema run's mean), for the grammar's cost.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jsonschema

from sloserve.bench.common import machine_info, print_table, write_json
from sloserve.bench.spec import ClosedLoop, policy_engine, run_loops, run_once
from sloserve.replay.specbench import ordinary_prompts
from sloserve.runtime.config import EngineConfig
from sloserve.runtime.engine import Engine
from sloserve.runtime.request import SamplingParams
from sloserve.runtime.scheduler import SchedulerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "active"],
    "additionalProperties": False,
}


class ParamsLoop(ClosedLoop):
    """bench/spec.py's closed loop with given sampling parameters (one per prompt)."""

    def __init__(self, eng: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 concurrency: int) -> None:
        self._given = params
        super().__init__(eng, prompts, [p.max_new_tokens for p in params], concurrency)

    def _submit(self) -> None:
        self.params = self._given
        super()._submit()

    def valid_documents(self) -> tuple[int, int, float]:
        """(finished requests whose text parses and validates against SCHEMA, finished, their
        mean output tokens)."""
        ok = 0
        for r in self.finished:
            try:
                jsonschema.validate(json.loads(r.output_text), SCHEMA)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        mean_len = statistics.mean(len(r.output_ids) for r in self.finished)
        return ok, len(self.finished), mean_len


def _run(engines: dict[str, Engine], policies: list[str], prompts, params, b: int, n: int,
         repeats: int) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for rep in range(repeats):
        order = policies[rep % len(policies):] + policies[: rep % len(policies)]
        loops = [ParamsLoop(engines[name], prompts, params, b) for name in order]
        for name, lp, res in zip(order, loops, run_loops(loops, n)):
            res["valid"], res["finished"], res["doc_tokens"] = lp.valid_documents()
            res.pop("tpots")
            runs[name].append(res)
    return runs


def _rows(runs: dict[str, list[dict]], b: int, mode: str) -> list[dict]:
    rows = []
    for name, rs in runs.items():
        paired = [r["tok_s"] / a["tok_s"] for r, a in zip(rs, runs["ar"])] if "ar" in runs \
            else [float("nan")]
        mid = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
        rows.append({"batch": b, "mode": mode, "policy": name, **mid,
                     "tok_s_all": [r["tok_s"] for r in rs],
                     "valid_all": [f"{r['valid']}/{r['finished']}" for r in rs],
                     "speedup_vs_ar": statistics.median(paired), "speedup_vs_ar_all": paired})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="ar,fixed:3,specserve")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--any-whitespace", action="store_true",
                    help="JSON with free whitespace between elements (default: compact)")
    ap.add_argument("--plain", action="store_true",
                    help="also run without the schema (ignore_eos, the schema run's lengths)")
    ap.add_argument("--kv-tokens", type=int, default=16384)
    ap.add_argument("--out", default="out/bench_structured.json")
    args = ap.parse_args(argv)
    policies = args.policies.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    base = Engine(EngineConfig(
        spec_policy="fixed:1", k_max=args.k_max, kv_cache_tokens=args.kv_tokens,
        constrained_json_disable_any_whitespace=not args.any_whitespace,
        scheduler=SchedulerConfig(max_running_requests=max(batches), max_step_tokens=8192)))
    engines = {name: policy_engine(base, name, args.k_max, "model", args.kv_tokens)
               for name in policies}
    schema = json.dumps(SCHEMA)
    rows: list[dict] = []
    for b in batches:
        n = max(2 * b, args.min_requests)
        prompts = [base.encode(p)[: args.prompt_tokens] for p in ordinary_prompts(n)]
        params = [SamplingParams(max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, json_schema=schema, seed=i)
                  for i in range(n)]
        for eng in engines.values():  # warm-up, and the grammar compiled once
            run_once(eng, prompts[:1], 4)
            eng.generate(prompts[:1], params[:1])
        rows += _rows(_run(engines, policies, prompts, params, b, n, args.repeats), b, "schema")
        if args.plain:
            mean_len = round(statistics.mean(r["doc_tokens"] for r in rows[-len(policies):]))
            plain = [SamplingParams(max_new_tokens=mean_len, temperature=args.temperature,
                                    ignore_eos=True, seed=i) for i in range(n)]
            rows += _rows(_run(engines, policies, prompts, plain, b, n, args.repeats), b, "plain")
    table = [[r["batch"], r["mode"], r["policy"], f"{r['tok_s']:.1f}",
              f"{r['speedup_vs_ar']:.2f}x", f"{r['mean_tpot_ms']:.1f}",
              "-" if r["policy"] == "ar" else f"{r['mean_accepted_length']:.2f}",
              f"{r['mean_k']:.2f}", f"{r['doc_tokens']:.1f}",
              " ".join(r["valid_all"]) if r["mode"] == "schema" else "-"] for r in rows]
    print_table(["batch", "mode", "policy", "tok/s", "vs ar", "TPOT ms", "accept len",
                 "mean k", "tokens/req", "valid (per repeat)"], table)
    result = {"benchmark": "structured", "args": vars(args), "schema": SCHEMA,
              "machine": machine_info(), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
