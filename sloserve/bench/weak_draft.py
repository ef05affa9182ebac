"""A weak draft for benchmarks of adaptivity (issue #32, acceptance 3: "with any draft ... a
draft that barely agrees with the target"): a copy of a draft directory (HF LLaMA layout, as
the presets ship) whose chosen decoder layers write nothing to the residual stream (their
attention output and MLP down projections zeroed). The draft keeps its shapes, so every
forward costs what the original's does, but it predicts from fewer layers and agrees with
the target less. The weights are the original's; nothing is trained.

    python -m sloserve.bench.weak_draft --out out/weak_draft [--draft smollm2] [--keep 1]

Writes OUT (a model directory for `--draft-model-path`) and prints its path."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def weaken(src: Path, out: Path, keep: int) -> list[str]:
    """Copy src to out with decoder layers >= keep silenced; returns the zeroed tensors."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    if not 0 <= keep < layers:
        raise ValueError(f"--keep must be in [0, {layers - 1}] for this {layers}-layer draft")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "sloserve-manifest.json"):
            shutil.copy2(f, out / f.name)
    weights = load_file(str(src / "model.safetensors"))
    zeroed = []
    for name, w in weights.items():
        parts = name.split(".")  # model.layers.<i>.self_attn.o_proj.weight
        if (len(parts) > 3 and parts[1] == "layers" and int(parts[2]) >= keep
                and parts[-2] in ("o_proj", "down_proj")):
            w.zero_()
            zeroed.append(name)
    if len(zeroed) != 2 * (layers - keep):
        raise ValueError(f"{src}: expected o_proj and down_proj in each layer, found {zeroed}")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "sloserve-weak-draft.json").write_text(json.dumps(
        {"source": str(src), "kept_layers": keep, "zeroed": zeroed}, indent=1))
    return zeroed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sloserve.bench.weak_draft",
                                description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="the weak draft's directory")
    p.add_argument("--draft", default="smollm2",
                   help="a draft directory, or a preset whose draft is weakened")
    p.add_argument("--keep", type=int, default=1,
                   help="decoder layers kept (the first KEEP); the others are silenced")
    args = p.parse_args(argv)
    src = Path(args.draft)
    if not src.is_dir():
        from sloserve.runtime.models.presets import resolve_pair

        try:
            _, draft = resolve_pair(args.draft, None, "model")
        except ValueError as e:
            p.error(f"argument --draft: {e}")
        if draft is None:
            p.error(f"argument --draft: {args.draft!r} has no draft")
        src = Path(draft)
    try:
        zeroed = weaken(src, Path(args.out), args.keep)
    except ValueError as e:
        p.error(f"argument --keep: {e}")
    print(f"{args.out}: {src.name} with {len(zeroed) // 2} of its layers silenced")
    return 0


if __name__ == "__main__":
    sys.exit(main())
