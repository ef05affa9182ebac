"""Command lines take SLOs with their unit and no abbreviated options: `--tpot-slo 0.03`
(seconds or milliseconds?) and `--tp 2` (taken as --tpot-slo) are errors, in every CLI."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from sloserve.units import duration

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text,seconds", [("30ms", 0.03), ("0.03s", 0.03), ("1.5s", 1.5),
                                          (" 250ms ", 0.25), (".5s", 0.5), ("30 ms", 0.03)])
def test_duration_with_unit(text, seconds):
    assert duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["30", "0.03", "30us", "-1s", "0ms", "fast", "", "1e3ms",
                                  "nanms"])
def test_duration_without_a_valid_unit_is_an_error_showing_the_forms(text):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        duration(text)
    assert "30ms" in str(e.value) and "0.03s" in str(e.value)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_launch_refuses_a_bare_slo_number():
    out = _run("sloserve.launch", "--engine", "builtin", "--tpot-slo", "0.03")
    assert out.returncode == 2
    assert "argument --tpot-slo" in out.stderr and "no unit" in out.stderr
    assert "30ms" in out.stderr and "0.03s" in out.stderr


def test_launch_refuses_abbreviated_options():
    """--tp used to be taken as --tpot-slo."""
    out = _run("sloserve.launch", "--engine", "builtin", "--tp", "2ms")
    assert out.returncode == 2 and "unrecognized arguments: --tp" in out.stderr


def test_sglang_launcher_refuses_abbreviations_and_bare_slos():
    from sloserve.cli.sglang_launch import build_parser

    parser = build_parser()
    # SGLang's own options pass through unknown, so an abbreviation must not be expanded
    args, rest = parser.parse_known_args(["--tp", "2"])
    assert args.tpot_slo is None and rest == ["--tp", "2"]
    with pytest.raises(SystemExit):
        parser.parse_known_args(["--tpot-slo", "30"])


def _parsers_without_allow_abbrev() -> list[str]:
    """`file:line` of every argparse.ArgumentParser(...) in sloserve/ that does not pass
    allow_abbrev=False."""
    bad = []
    for path in sorted((REPO / "sloserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None)
                    == "ArgumentParser"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            flag = kw.get("allow_abbrev")
            if not (isinstance(flag, ast.Constant) and flag.value is False):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return bad


def test_every_parser_refuses_abbreviations():
    assert _parsers_without_allow_abbrev() == []


def test_profiler_and_replay_refuse_abbreviations():
    from sloserve.cli.replay import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--tpot", "30"])
    assert e.value.code == 2
    out = _run("sloserve.profiler", "--qui")
    assert out.returncode == 2 and "unrecognized arguments: --qui" in out.stderr


def _builtin_config(*argv: str):
    from sloserve.launch import build_parser, config_from_args

    parser = build_parser()
    return config_from_args(parser, parser.parse_args(list(argv)))


def test_builtin_launch_takes_spec_options_into_the_shared_config():
    """--spec-options as on the SGLang side: carried by EngineConfig as the shared
    SpeculationConfig, and the policy the engine builds from it has them."""
    from sloserve.estimator.cost_model import CostModel, ForwardCost
    from sloserve.policies.registry import make_policy

    cfg = _builtin_config("--spec-policy", "specserve", "--k-max", "4", "--tpot-slo", "30ms",
                          "--spec-options", "uniform_margin=0, lag_cap=none")
    spec = cfg.speculation
    assert (spec.policy, spec.k_max, spec.options) == (
        "specserve", 4, (("uniform_margin", "0"), ("lag_cap", "none")))
    assert spec.tpot_slo == pytest.approx(0.03)
    free = ForwardCost.free()
    policy = make_policy(spec.policy, CostModel(free, free), k_max=spec.k_max,
                         options=spec.options)
    assert policy.options.uniform_margin == 0.0 and policy.options.lag_cap is None
    assert _builtin_config().speculation.options == ()


@pytest.mark.parametrize("argv, option, names", [
    (["--spec-options", "foo=1"], "--spec-options", "foo"),
    (["--spec-options", "uniform_margin"], "--spec-options", "uniform_margin"),
    (["--spec-policy", "fixed:3", "--spec-options", "uniform_margin=0"], "--spec-options",
     "takes no options"),
    (["--spec-policy", "nope"], "--spec-policy", "nope"),
])
def test_builtin_launch_names_the_option_at_fault(argv, option, names, capsys):
    with pytest.raises(SystemExit) as e:
        _builtin_config(*argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {option}" in err and names in err, err


@pytest.mark.parametrize("layers", ["2,4", "x", "0"])
def test_train_draft_names_a_bad_layers_option(layers, capsys):
    """--layers: one positive number on the CPU (a list trains several drafts with --device
    cuda): a CLI error naming the option, before anything is loaded."""
    from sloserve import train_draft

    with pytest.raises(SystemExit) as e:
        train_draft.main(["--layers", layers, "--out", "/nonexistent/never-written"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --layers" in err, err
