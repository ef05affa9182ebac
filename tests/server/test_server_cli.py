"""`python -m sloserve.launch` options: SLO durations, errors naming the option, one frozen
EngineConfig built from the command line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from sloserve.launch import build_parser, config_from_args, http_options


def parse(argv: list[str]):
    parser = build_parser()
    return config_from_args(parser, parser.parse_args(argv))


BAD = [
    (["--tpot-slo", "30us"], "--tpot-slo"), (["--tpot-slo", "fast"], "--tpot-slo"),
    (["--tpot-slo", "0.03"], "--tpot-slo"), (["--ttft-slo", "500"], "--ttft-slo"),
    (["--ttft-slo", "-1s"], "--ttft-slo"), (["--ttft-slo", "0"], "--ttft-slo"),
    (["--spec-policy", "magic"], "--spec-policy"), (["--spec-policy", "fixed:x"], "--spec-policy"),
    (["--k-max", "99"], "--k-max"), (["--k-max", "two"], "--k-max"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--kv-cache-tokens", "-5"], "--kv-cache-tokens"), (["--port", "70000"], "--port"),
    (["--model-path", "/no/such/dir"], "--model-path"),
    (["--drafter", "ngram", "--draft-model-path", "."], "--draft-model-path"),
    (["--log-level", "loud"], "--log-level"), (["--drafter", "oracle"], "--drafter"),
    (["--max-queued-requests", "-1"], "--max-queued-requests"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes"),
    (["--request-header-timeout", "0"], "--request-header-timeout"),
    (["--request-body-timeout", "soon"], "--request-body-timeout"),
    (["--tool-call-parser", "qwen9"], "--tool-call-parser"),
]


@pytest.mark.parametrize("argv,option", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_name_the_option(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    assert f"argument {option}" in capsys.readouterr().err


def test_config_from_cli_is_built_once_and_frozen():
    cfg = parse(["--tpot-slo", "30ms", "--ttft-slo", "0.5s", "--spec-policy", "fixed:3",
                 "--k-max", "4", "--max-running-requests", "8", "--kv-cache-tokens", "4096"])
    assert (cfg.tpot_slo, cfg.ttft_slo, cfg.spec_policy, cfg.k_max) == (0.03, 0.5, "fixed:3", 4)
    assert cfg.scheduler.max_running_requests == 8 and cfg.kv_cache_tokens == 4096
    assert cfg.model_path is None and cfg.drafter == "model"  # the built-in pair
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.k_max = 2
    default = parse([])
    assert default.spec_policy == "specserve-slo" and default.tpot_slo is None
    assert parse(["--drafter", "ngram"]).drafter == "ngram"


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "sloserve.launch", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for action in build_parser()._actions:
        for opt in action.option_strings:
            assert opt in out.stdout
        assert action.help, action.option_strings


def test_server_limits_and_access_options():
    parser = build_parser()
    args = parser.parse_args(["--max-queued-requests", "16", "--api-key", "k", "--host",
                              "0.0.0.0", "--allowed-hosts", "api.example", "localhost",
                              "--allowed-origins", "https://app.example",
                              "--max-request-body-bytes", "1000", "--request-header-timeout",
                              "2.5", "--request-body-timeout", "7"])
    assert config_from_args(parser, args).scheduler.max_queued_requests == 16
    opts = http_options(args)
    assert (opts.api_key, opts.host_names(), opts.allowed_origins) == (
        "k", ("api.example", "localhost"), ("https://app.example",))
    assert (opts.max_body_bytes, opts.header_timeout_s, opts.body_timeout_s) == (1000, 2.5, 7)
    default = http_options(parser.parse_args([]))
    assert default.api_key is None and default.allowed_origins == ()
    assert set(default.host_names()) == {"127.0.0.1", "localhost", "::1"}
    assert parse([]).scheduler.max_queued_requests is None


def test_tool_call_parser_reaches_the_http_options():
    parser = build_parser()
    assert http_options(parser.parse_args([])).tool_call_parser is None
    for name in ("qwen25", "qwen", "hermes", "llama3"):
        assert http_options(parser.parse_args(["--tool-call-parser", name])).tool_call_parser \
            == name
