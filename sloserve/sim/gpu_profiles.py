"""GPU-class cost profiles from published figures, for the simulator.

    python -m sloserve.sim.gpu_profiles [--out-dir configs/profiles/gpu]

writes one profile file (the profiler's schema, readable by `read_profile`) per entry below,
each with a top-level "source" object: the published numbers, the assumptions and the
derivation. `read_profile` ignores the extra key.

Derivation (docs/design.md sec. 2, T = a N_ctx + b N_q + c, N_ctx counting query tokens):
    a = KV bytes per token / HBM bandwidth           (attention streams the KV cache)
    b = 2 * params FLOP per token / (peak * eff)     (compute per query token)
    c = weights bytes / HBM bandwidth / eff_mem      (or solved from a measured step time)
TurboSpec (sec. 3, Fig. 2) measured, for Llama-2-7B + a 160M draft under vLLM on one H100:
7.4 ms per plain decode step at batch 50, and 12.6 ms per speculative step with k = 2
(per-token 12.6 / 6.3 / 4.2 ms for 1 / 2 / 3 tokens). c_t and c_d are solved from those two
numbers; SmartSpec (sec. 4.3, Fig. 7) fits the same model for Vicuna-7B + Llama-160M on an
A100-80G but prints no coefficients, so that profile applies the H100 fit's efficiencies and
fixed draft cost to the A100's published bandwidth and peak.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from sloserve.estimator.cost_model import ForwardCost
from sloserve.estimator.profile_file import ModelProfile, Profile, profile_filename, to_json

LLAMA2_7B = {"params": 6.74e9, "layers": 32, "kv_dim": 4096}  # 32 KV heads x 128 (MHA)
LLAMA_160M = {"params": 0.162e9, "layers": 12, "kv_dim": 768}  # JackFram/llama-160m shape
H100_SXM = {"bw": 3.35e12, "bf16": 989e12}  # NVIDIA H100 SXM5 80GB datasheet (dense)
A100_SXM = {"bw": 2.039e12, "bf16": 312e12}  # NVIDIA A100 80GB SXM datasheet (dense)
ELEM = 2  # bytes per bf16/fp16 element
EFF_COMPUTE_TARGET = 0.70  # share of peak FLOPs a 7B verify reaches (assumed)
EFF_COMPUTE_DRAFT = 0.35  # a 160M model's small GEMMs (assumed)
# TurboSpec Fig. 2 (text of sec. 3)
TS_BATCH, TS_PLAIN_S, TS_SPEC_S, TS_K = 50, 7.4e-3, 12.6e-3, 2
TS_CONTEXT = 256  # assumed context per request: TurboSpec's sec. 6.1 uses 256-token inputs


def kv_bytes(m: dict) -> float:
    return 2 * m["layers"] * m["kv_dim"] * ELEM


def b_coef(m: dict, hw: dict, eff: float) -> float:
    return 2 * m["params"] / (hw["bf16"] * eff)


@dataclass(frozen=True)
class Derived:
    target: ForwardCost
    draft: ForwardCost
    notes: dict


def turbospec_h100() -> Derived:
    """Solve c_t and c_d from TurboSpec's two step times (overhead folded into c_t)."""
    hw = H100_SXM
    a_t, b_t = kv_bytes(LLAMA2_7B) / hw["bw"], b_coef(LLAMA2_7B, hw, EFF_COMPUTE_TARGET)
    a_d, b_d = kv_bytes(LLAMA_160M) / hw["bw"], b_coef(LLAMA_160M, hw, EFF_COMPUTE_DRAFT)
    B, n = TS_BATCH, TS_CONTEXT
    c_t = TS_PLAIN_S - a_t * B * (n + 1) - b_t * B
    verify = a_t * B * (n + 1 + TS_K) + b_t * B * (TS_K + 1) + c_t
    # k draft forwards of B requests; ctx n + j, one query token each (steady state)
    c_d = ((TS_SPEC_S - verify) - sum(a_d * B * (n + j) + b_d * B for j in range(1, TS_K + 1))
           ) / TS_K
    notes = {"weights_load_s": LLAMA2_7B["params"] * ELEM / hw["bw"],
             "implied_memory_efficiency": LLAMA2_7B["params"] * ELEM / hw["bw"] / c_t}
    return Derived(ForwardCost(a_t, b_t, c_t), ForwardCost(a_d, b_d, c_d), notes)


def smartspec_a100() -> Derived:
    """The H100 fit's efficiencies on the A100's bandwidth and peak; same fixed draft cost."""
    h = turbospec_h100()
    hw = A100_SXM
    eff_mem = h.notes["implied_memory_efficiency"]
    a_t, b_t = kv_bytes(LLAMA2_7B) / hw["bw"], b_coef(LLAMA2_7B, hw, EFF_COMPUTE_TARGET)
    c_t = LLAMA2_7B["params"] * ELEM / hw["bw"] / eff_mem
    a_d, b_d = kv_bytes(LLAMA_160M) / hw["bw"], b_coef(LLAMA_160M, hw, EFF_COMPUTE_DRAFT)
    return Derived(ForwardCost(a_t, b_t, c_t), ForwardCost(a_d, b_d, h.draft.c),
                   {"memory_efficiency_from_h100_fit": eff_mem})


COMMON_ASSUMPTIONS = [
    "a = KV bytes/token / HBM bandwidth: attention streams the KV cache at peak bandwidth",
    f"b = 2*params / (peak dense bf16 * eff), eff {EFF_COMPUTE_TARGET} target, "
    f"{EFF_COMPUTE_DRAFT} draft",
    "Llama-2-7B: 6.74e9 params, 32 layers, 32 KV heads x 128 (524288 KV bytes/token bf16); "
    "Llama-160M: 0.162e9 params, 12 layers, hidden 768 (36864 KV bytes/token)",
    "step overhead (scheduling, sampling) folded into c_target: overhead = 0",
]


def profiles() -> dict[str, tuple[Profile, dict]]:
    h, a = turbospec_h100(), smartspec_a100()
    grid = {"batch_sizes": [TS_BATCH], "context_lens": [TS_CONTEXT], "query_lens": [1, 3]}
    h100 = Profile(
        target=ModelProfile("meta-llama/Llama-2-7b-hf", "", h.target),
        draft=ModelProfile("llama-160m", "", h.draft),
        device="cuda-h100-sxm-80gb", dtype="bfloat16", overhead=0.0, grid=grid,
        mode="published", created="2026-11-21T00:00:00+00:00")
    h100_src = {
        "paper": "TurboSpec (Liu et al.), sec. 3 and Fig. 2: Llama-2-7B target, Llama-2 160M "
                 "draft, vLLM, one NVIDIA H100 80GB",
        "published": {"plain_step_s_batch50": TS_PLAIN_S, "spec_step_s_batch50_k2": TS_SPEC_S,
                      "per_token_s_k2": [12.6e-3, 6.3e-3, 4.2e-3],
                      "hbm_bandwidth_Bps": H100_SXM["bw"], "peak_bf16_flops": H100_SXM["bf16"]},
        "assumptions": COMMON_ASSUMPTIONS + [
            f"Fig. 2 context per request: {TS_CONTEXT} tokens (not stated; sec. 6.1 uses "
            "256-token inputs)",
            "c_target solved from 7.4 ms; c_draft from 12.6 ms minus the k=3-token verify",
        ],
        "derived": h.notes,
    }
    a100 = Profile(
        target=ModelProfile("lmsys/vicuna-7b-v1.5", "", a.target),
        draft=ModelProfile("llama-160m", "", a.draft),
        device="cuda-a100-sxm-80gb", dtype="float16", overhead=0.0, grid={},
        mode="published", created="2026-11-21T00:00:00+00:00")
    a100_src = {
        "paper": "SmartSpec (Liu et al.), sec. 4.3 (T_fwd = alpha N_context + gamma N_batched "
                 "+ delta) and Table 1: Vicuna-7B + Llama-160M on one A100-80G. The paper "
                 "plots its fit (Fig. 7) but prints no coefficients.",
        "published": {"hbm_bandwidth_Bps": A100_SXM["bw"], "peak_bf16_flops": A100_SXM["bf16"]},
        "assumptions": COMMON_ASSUMPTIONS + [
            "c_target = weights bytes / bandwidth / (the memory efficiency implied by the "
            "H100 fit)",
            "c_draft = the H100 fit's c_draft (launch/host bound, same software)",
        ],
        "derived": a.notes,
    }
    return {"h100": (h100, h100_src), "a100": (a100, a100_src)}


def main(argv=None) -> None:
    import json

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[2] / "configs"
                                             / "profiles" / "gpu"))
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for prof, source in profiles().values():
        d = to_json(prof)
        d["source"] = source
        path = out / profile_filename(prof.target.key, prof.draft.key, prof.device, prof.dtype)
        path.write_text(json.dumps(d, indent=2) + "\n")
        t, dr = prof.target.cost, prof.draft.cost
        print(f"{path.name}: target a={t.a:.3e} b={t.b:.3e} c={t.c:.3e}; "
              f"draft a={dr.a:.3e} b={dr.b:.3e} c={dr.c:.3e}")


if __name__ == "__main__":
    main()
