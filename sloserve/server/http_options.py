"""The HTTP server's own settings (the engine's are EngineConfig): what `http_guards` and
`http_protocol` enforce. Free of heavy imports, so that the CLI can build it cheaply."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# --tool-call-parser: SGLang's names of the formats served (server/tool_calls.py)
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes", "llama3")


@dataclass(frozen=True)
class HTTPOptions:
    """The HTTP server's own settings (the engine's are EngineConfig)."""

    host: str = "127.0.0.1"  # the address the server is bound to
    api_key: str | None = None  # Bearer token required on every route but OPEN_PATHS
    allowed_hosts: tuple[str, ...] | None = None  # Host header names; None: from `host`
    allowed_origins: tuple[str, ...] = ()  # CORS: origins allowed to call (none: CORS off)
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 30.0  # the whole body must arrive within this
    header_timeout_s: float = 10.0  # a request's headers must arrive within this
    # what one request may ask for (a 400 naming the field beyond): samples per prompt (n),
    # prompts of a batch and samples in all (prompts x n), top log-probabilities per token
    max_n: int = 64
    max_batch_prompts: int = 256
    max_top_logprobs_num: int = 100
    # how chat answers write tool calls (TOOL_CALL_PARSERS); None: tool_choice "auto" is a 400
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")

    def host_names(self) -> tuple[str, ...] | None:
        """The Host names accepted; None accepts any (a wildcard bind without a list)."""
        if self.allowed_hosts is not None:
            return None if "*" in self.allowed_hosts else tuple(
                h.lower() for h in self.allowed_hosts)
        if self.host in ("", "0.0.0.0", "::"):
            return None  # reachable under any name: the operator lists them with allowed_hosts
        names = {self.host.lower()}
        if _is_loopback(self.host):
            names.update(_LOOPBACK_NAMES)
        return tuple(sorted(names))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
