"""Constrained decoding (xgrammar), penalties and min_new_tokens, exact under speculation.

- spec.py: `grammar_spec(regex=, json_schema=, ebnf=, response_format=)` -> GrammarSpec | None
- compiler.py: `GrammarCompiler` (xgrammar, per tokenizer + model vocabulary, LRU by (kind, text))
- grammar_state.py: `GrammarState` (mask, push / rollback, draft masks, verify masks, commit)
- processing.py: `RequestConstraints` (the per-position processing order and its distributions)
- byte_guard.py: keeps grammar output well-formed UTF-8 (xgrammar 0.2.7 does not everywhere)
- sloserve/runtime/penalties.py: the penalties themselves (no xgrammar)

Per request and step (one RequestConstraints `rc` per request; the grammar advances only here):
  draft round j:  pr = rc.draft(draft_logits_row, drafts); token from pr (argmax / draw from
                  pr.probs[0], q = pr.probs[0], confidence pr.confidence(0, token));
                  rc.push_draft(token) -> False: stop drafting this request (n-gram proposals
                  are only pushed: a forbidden one ends the chain, equivalent for a one-hot q)
  verify k <= s:  p = rc.target(target_logits[k + 1], drafts[:k])  (extra drafts rolled back)
                  greedy_accept(drafts[:k], p.argmax) or speculative_accept(drafts[:k], q[:k],
                  p.probs): a draft past p.n_valid is masked out in its row, so it is rejected
  commit:         rc.commit(tokens actually appended to the output, stop-trimmed)
  no drafts:      p = rc.target(logits[-1:], []), sample row 0, rc.commit([token])
"""

from sloserve.runtime.constraints.compiler import CompiledGrammar, GrammarCompiler
from sloserve.runtime.constraints.grammar_state import GrammarState, GrammarViolation
from sloserve.runtime.constraints.processing import Processed, RequestConstraints
from sloserve.runtime.constraints.spec import GrammarSpec, grammar_spec

__all__ = [
    "CompiledGrammar", "GrammarCompiler", "GrammarSpec", "GrammarState", "GrammarViolation",
    "Processed", "RequestConstraints", "grammar_spec",
]
