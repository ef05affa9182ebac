"""Constrained decoding (xgrammar), penalties and min_new_tokens, exact under speculation.

- spec.py: `grammar_spec(regex=, json_schema=, ebnf=, response_format=)` -> GrammarSpec | None
- compiler.py: `GrammarCompiler` (xgrammar, per tokenizer + model vocabulary, LRU by (kind, text))
- grammar_state.py: `GrammarState` (mask, push / rollback, draft masks, verify masks, commit)
- processing.py: `RequestConstraints` (the per-position processing order and its distributions)
- sloserve/runtime/penalties.py: the penalties themselves (no xgrammar)
"""

from sloserve.runtime.constraints.compiler import CompiledGrammar, GrammarCompiler
from sloserve.runtime.constraints.grammar_state import GrammarState, GrammarViolation
from sloserve.runtime.constraints.processing import Processed, RequestConstraints
from sloserve.runtime.constraints.spec import GrammarSpec, grammar_spec

__all__ = [
    "CompiledGrammar", "GrammarCompiler", "GrammarSpec", "GrammarState", "GrammarViolation",
    "Processed", "RequestConstraints", "grammar_spec",
]
