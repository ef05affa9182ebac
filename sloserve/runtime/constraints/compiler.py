"""Compiling constraints with xgrammar (CPU), for one tokenizer and one model vocabulary.

The model's vocabulary may be larger than the tokenizer's (padded embedding rows): xgrammar's
TokenizerInfo gets the model's size, treats the ids past the tokenizer as special tokens, and so
every mask covers the model's vocabulary with those ids forbidden. Stop tokens are the model's
EOS ids (as SGLang passes them): once the grammar is complete, only they are allowed.

Compiled grammars are cached by (kind, text) in a bounded LRU (xgrammar's own cache is off so
nothing is held twice). Invalid grammars raise InvalidRequest naming the request field.

Every grammar carries a ByteGuard (byte_guard.py) that keeps the output valid UTF-8, and for
JSON schemas free of raw control bytes: xgrammar 0.2.7 lets both through in places.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xgrammar as xgr

from sloserve.runtime.constraints.byte_guard import ByteGuard
from sloserve.runtime.constraints.spec import GrammarSpec
from sloserve.runtime.errors import InvalidRequest

# xgrammar errors read "[12:00:00] /project/cpp/x.cc:83: Check failed: (...) is false: message"
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false:\s*")


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    spec: GrammarSpec
    vocab_size: int  # the model's vocabulary: masks cover [0, vocab_size)
    compiled: xgr.CompiledGrammar
    guard: ByteGuard | None = None  # ANDed into every mask xgrammar fills


class GrammarCompiler:
    def __init__(
        self,
        tokenizer_info: xgr.TokenizerInfo,
        *,
        any_whitespace: bool = True,
        cache_size: int = 256,
        max_threads: int = 2,
    ):
        """any_whitespace: JSON schemas allow any whitespace between elements (SGLang's default;
        False gives the compact one-line form)."""
        self.info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.any_whitespace = any_whitespace
        self._xgr = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._guards: dict[bool, ByteGuard] = {}
        self._lock = threading.Lock()  # the server may compile off the engine thread

    @classmethod
    def from_hf(
        cls, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], **kw
    ) -> GrammarCompiler:
        """tokenizer: a Hugging Face tokenizer; vocab_size: the model's (>= the tokenizer's)."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(set(stop_token_ids))
        )
        return cls(info, **kw)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.info.stop_token_ids)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                return hit
        guard = self.byte_guard(json=spec.kind == "json_schema")
        compiled = CompiledGrammar(spec, self.vocab_size, self._compile(spec), guard)
        with self._lock:
            self._cache[spec.key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def byte_guard(self, json: bool) -> ByteGuard:
        """The UTF-8 guard (JSON variant: no raw control bytes either), built once per kind."""
        guard = self._guards.get(json)
        if guard is None:
            passthrough = [*self.info.special_token_ids, *self.info.stop_token_ids]
            guard = ByteGuard(self.info.decoded_vocab, self.vocab_size, passthrough, json)
            self._guards[json] = guard
        return guard

    def cache_len(self) -> int:
        return len(self._cache)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "regex":
                return self._xgr.compile_regex(spec.text)
            if spec.kind == "json_schema":
                return self._xgr.compile_json_schema(spec.text, any_whitespace=self.any_whitespace)
            if spec.kind == "ebnf":
                return self._xgr.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequest(spec.source or spec.kind, _clean(str(e))) from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")


def _clean(message: str) -> str:
    """xgrammar's message without its log-location prefix, first line only."""
    line = next((s for s in message.strip().splitlines() if s.strip()), message)
    return _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", line.strip())) or message
