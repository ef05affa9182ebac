"""Each request's RequestConstraints, from its SamplingParams, for one engine (one tokenizer and
model vocabulary). The grammar compiler is built on the first request with a grammar, so an
engine whose requests use none pays nothing for it."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from sloserve.runtime.constraints.compiler import CompiledGrammar, GrammarCompiler
from sloserve.runtime.constraints.grammar_state import GrammarState
from sloserve.runtime.constraints.processing import RequestConstraints
from sloserve.runtime.constraints.spec import grammar_spec
from sloserve.runtime.errors import InvalidRequest
from sloserve.runtime.sampling_params import SamplingParams


class ConstraintFactory:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int], max_draft: int,
                 any_whitespace: bool = True):
        """eos_ids: the model's stop tokens (the grammar's: once it is complete only they are
        allowed, and min_new_tokens forbids them); max_draft: the engine's k_max;
        any_whitespace: JSON schemas allow any whitespace between elements (False: compact)."""
        self.any_whitespace = any_whitespace
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted({int(t) for t in eos_ids})
        self.max_draft = max_draft
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()  # the server compiles off the engine thread too

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.from_hf(self.tokenizer, self.vocab_size,
                                                         self.eos_ids,
                                                         any_whitespace=self.any_whitespace)
            return self._compiler

    def grammar(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled grammar (cached by its text), or None. Thread-safe. Raises
        InvalidRequest naming the field (regex, json_schema, ebnf) when it does not compile."""
        spec = grammar_spec(regex=params.regex, json_schema=params.json_schema, ebnf=params.ebnf)
        if spec is None:
            return None
        compiled = self.compiler().compile(spec)
        if not bool(GrammarState(compiled, max_draft=0).allowed().any()):
            # e.g. a JSON schema whose $ref loops with no base case: nothing matches it, and
            # every token would be masked from the first one
            raise InvalidRequest(spec.source or spec.kind, "admits no output: no token can "
                                 "start a match (e.g. a $ref that loops without a base case)")
        return compiled

    def build(self, params: SamplingParams, prompt_ids: Sequence[int]) -> RequestConstraints:
        compiled = self.grammar(params)
        state = None if compiled is None else GrammarState(compiled, max_draft=self.max_draft)
        return RequestConstraints(params, self.vocab_size, prompt_ids,
                                  penalties=params.penalties, grammar=state,
                                  stop_ids=[*self.eos_ids, *params.stop_token_ids])
