"""Incremental detokenization and stop-string detection.

Text comes from decoding the tokens since the previous emit (prefix_offset..) against those
before them, so each step costs O(window) and merges across the boundary come out right;
and a trailing incomplete UTF-8 sequence ("\ufffd") is held back until it completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_HELD = 4  # a UTF-8 character spans at most 4 byte tokens; past that the bytes are invalid


@dataclass
class DetokState:
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    # the request's decoding options (SGLang's and vLLM's sampling parameters)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _decode(self, ids: list[int], st: DetokState) -> str:
        kw = {} if st.spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        return self.tokenizer.decode(ids, skip_special_tokens=st.skip_special_tokens, **kw)

    def push(self, st: DetokState, token: int) -> str:
        """Append one token; return the newly stable text (maybe empty)."""
        st.ids.append(token)
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], st)
        full = self._decode(st.ids[st.prefix_offset :], st)
        held = len(st.ids) - st.read_offset
        if len(full) > len(prefix) and (not full.endswith("\ufffd") or held > _MAX_HELD):
            new = full[len(prefix) :]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.ids)
            st.text += new
            return new
        return ""

    def flush(self, st: DetokState) -> str:
        """At the end of a request: emit whatever is held back."""
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], st)
        full = self._decode(st.ids[st.prefix_offset :], st)
        new = full[len(prefix) :] if full.startswith(prefix) else ""
        st.read_offset = len(st.ids)
        st.text += new
        return new


def find_stop(text: str, new_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters of text.
    Returns (index where it starts, the stop string) or None."""
    if not stops or new_len == 0:
        return None
    best = None
    for s in stops:
        lo = max(0, len(text) - new_len - len(s) + 1)
        i = text.find(s, lo)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string: text
    that must not be streamed yet, since the next tokens may complete the stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
