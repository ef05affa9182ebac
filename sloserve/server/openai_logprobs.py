"""OpenAI's `logprobs` objects, from token ids and their log-probabilities.

Completions: {"tokens", "token_logprobs", "top_logprobs" (one {token: logprob} per token, or
None), "text_offset"}; chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}.
Output tokens' values come from the engine (the distribution each was sampled from: penalties
and grammar mask applied, temperature-scaled, as SGLang reports them); echoed prompt tokens'
values are the target model's own (the first prompt token has none: null).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# per token: its (token id, logprob) top list, or None where nothing was asked / known
Tops = Sequence[Sequence[tuple[int, float]] | None]


@dataclass
class Entries:
    """Token ids with their log-probabilities and top lists, in order."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[Sequence[tuple[int, float]] | None] = field(default_factory=list)

    def add(self, ids: Sequence[int], logprobs: Sequence[float | None], tops: Tops) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.tops.extend(tops)


def completion_logprobs(tokenizer, e: Entries, k: int, offset: int = 0) -> dict:
    """The completions object; offset: text_offset of the first token (the characters before
    it in the choice's text)."""
    tokens = [tokenizer.decode([t]) for t in e.ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops: list[dict | None] = []
    for row in e.tops:
        tops.append(None if row is None or k == 0 else
                    {tokenizer.decode([t]): v for t, v in row[:k]})
    return {"tokens": tokens, "token_logprobs": list(e.logprobs), "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer, e: Entries, k: int) -> dict:
    def entry(t: int, v: float | None) -> dict:
        s = tokenizer.decode([t])
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    content = []
    for t, v, row in zip(e.ids, e.logprobs, e.tops):
        top = [entry(u, w) for u, w in (row or [])[:k]]
        content.append({**entry(t, v), "top_logprobs": top})
    return {"content": content}
