"""The byte guard's DFA against Python's strict UTF-8 decoder, and its effect on a grammar that
xgrammar 0.2.7 matches leniently."""

from __future__ import annotations

import random

import xgrammar as xgr

from sloserve.runtime.constraints import GrammarState, grammar_spec
from sloserve.runtime.constraints.bitmask import allocate, to_bool
from sloserve.runtime.constraints.byte_guard import BOUND, REJECT, ByteGuard


def _walk(guard: ByteGuard, tokens: list[int]) -> int:
    state = BOUND
    for t in tokens:
        state = guard.next(state, t)
        if state == REJECT:
            break
    return state


def test_dfa_agrees_with_the_strict_utf8_decoder():
    """Random byte strings cut into random tokens: the guard accepts every prefix exactly when
    the bytes so far are a well-formed UTF-8 prefix, and ends at BOUND exactly when they decode."""
    rng = random.Random(0)
    pieces = [bytes([b]) for b in range(256)] + ["é".encode(), "中".encode(), "😀".encode(),
                                                  b"\xed\xa0", b"\xf0\x80", b"ab", b"\xe0\xa4"]
    guard = ByteGuard(pieces, len(pieces), passthrough=(), json=False)
    interesting = [i for i, p in enumerate(pieces) if p[0] >= 0x80 or p.isalpha()]
    for _ in range(3000):
        toks = [rng.choice(interesting) for _ in range(rng.randint(1, 5))]
        data = b"".join(pieces[t] for t in toks)
        try:
            data.decode("utf-8")
            valid = True
        except UnicodeDecodeError as e:
            valid = False
            incomplete = e.reason == "unexpected end of data"
        state = _walk(guard, toks)
        assert (state == BOUND) == valid, data
        if not valid:
            assert (state != REJECT) == incomplete, data


def test_json_guard_rejects_control_bytes_only_in_json():
    pieces = [b"\t", b"\n", b"\r", b"\x01", b"a\x1fb", b"x"]
    plain = ByteGuard(pieces, 6, passthrough=(), json=False)
    js = ByteGuard(pieces, 6, passthrough=(), json=True)
    assert [plain.next(BOUND, t) != REJECT for t in range(6)] == [True] * 6
    assert [js.next(BOUND, t) != REJECT for t in range(6)] == [False, True, True, False, False, True]


def test_grammar_never_offers_malformed_utf8(compiler, tokenizer):
    """Inside a JSON string, after the byte 0xED xgrammar also offers 0xA0..0xBF (surrogates);
    the guarded state offers only 0x80..0x9F, and only continuation bytes at all."""
    g = compiler.compile(grammar_spec(json_schema='{"type": "string"}'))
    byte_tok = {b[0]: i for i, b in enumerate(compiler.info.decoded_vocab) if len(b) == 1}
    st = GrammarState(g)
    prefix = tokenizer.encode('"a', add_special_tokens=False) + [byte_tok[0xED]]
    st.commit(prefix)
    allowed = st.allowed()
    ok = [b for b in range(256) if b in byte_tok and allowed[byte_tok[b]]]
    assert ok == list(range(0x80, 0xA0))
    assert not st.push(byte_tok[0xA5])
    assert st.push(byte_tok[0x9F]) and st.push(byte_tok[0x80])  # U+D7C0, well formed
    first = [compiler.info.decoded_vocab[t][0] for t in allowed.nonzero().flatten().tolist()]
    assert all(0x80 <= b < 0xA0 for b in first)
    # bare xgrammar offers the surrogate half too
    m = xgr.GrammarMatcher(g.compiled)
    assert all(m.accept_token(t) for t in prefix)
    bm = allocate(1, g.vocab_size)
    m.fill_next_token_bitmask(bm)
    assert to_bool(bm, g.vocab_size)[0, byte_tok[0xA5]]
