"""A byte-level guard ANDed into xgrammar's masks: the output stays valid UTF-8 (and, for JSON,
free of raw control bytes).

xgrammar 0.2.7 matches character classes on leniently decoded UTF-8: negated classes such as a
JSON string's [^"\\] accept encoded surrogates (ED A0..BF ..) and overlong forms (F0 80..8F ..),
which are not text (a detokenizer shows them as U+FFFD, so a maxLength string can come out
longer than its bound), and a JSON string with minLength / maxLength accepts raw U+0000..U+001F
other than CR and LF, which JSON forbids (xgrammar issue #800). Both are removed by a small DFA
over the token bytes (RFC 3629's well-formed sequences; JSON mode also rejects control bytes
other than LF and CR, never needed raw since tab is optional whitespace): per DFA state, the
mask of tokens that keep the bytes well formed, precomputed for the whole vocabulary, so each
decode position costs one table lookup and one AND of [W] words.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from sloserve.runtime.constraints.bitmask import from_bool

# DFA states: at a character boundary, or inside a multi-byte character needing more bytes
BOUND, CONT1, CONT2, CONT3, AFTER_E0, AFTER_ED, AFTER_F0, AFTER_F4, REJECT = range(9)
NUM_STATES = 9


def _byte_table(json: bool) -> np.ndarray:
    """[NUM_STATES, 256] int8: the state after one byte (REJECT absorbs)."""
    t = np.full((NUM_STATES, 256), REJECT, dtype=np.int8)
    t[BOUND, 0x00:0x80] = BOUND
    if json:
        t[BOUND, 0x00:0x20] = REJECT
        t[BOUND, [0x0A, 0x0D]] = BOUND
    t[BOUND, 0xC2:0xE0] = CONT1
    t[BOUND, 0xE0] = AFTER_E0
    t[BOUND, 0xE1:0xF0] = CONT2
    t[BOUND, 0xED] = AFTER_ED
    t[BOUND, 0xF0] = AFTER_F0
    t[BOUND, 0xF1:0xF4] = CONT3
    t[BOUND, 0xF4] = AFTER_F4
    t[CONT1, 0x80:0xC0] = BOUND
    t[CONT2, 0x80:0xC0] = CONT1
    t[CONT3, 0x80:0xC0] = CONT2
    t[AFTER_E0, 0xA0:0xC0] = CONT1  # no overlong 3-byte forms
    t[AFTER_ED, 0x80:0xA0] = CONT1  # no surrogates
    t[AFTER_F0, 0x90:0xC0] = CONT2  # no overlong 4-byte forms
    t[AFTER_F4, 0x80:0x90] = CONT2  # nothing past U+10FFFF
    return t


class ByteGuard:
    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int,
                 passthrough: Iterable[int], json: bool):
        """decoded_vocab: each token's bytes (xgrammar's TokenizerInfo.decoded_vocab);
        passthrough: ids left to the grammar alone (special and stop tokens: no bytes)."""
        table = _byte_table(json)
        keep = set(passthrough)
        toks = [b"" if i in keep or i >= len(decoded_vocab) else decoded_vocab[i]
                for i in range(vocab_size)]
        L = max(1, max(len(b) for b in toks))
        data = np.full((vocab_size, L), -1, dtype=np.int16)  # [V, L] bytes, -1 = past the end
        for i, b in enumerate(toks):
            data[i, : len(b)] = np.frombuffer(b, dtype=np.uint8)
        # trans[s, t]: the state after token t's bytes from state s; one column of bytes at a time
        trans = np.repeat(np.arange(NUM_STATES, dtype=np.int8)[:, None], vocab_size, axis=1)
        for pos in range(L):
            byte = data[:, pos]  # [V]
            live = byte >= 0
            trans[:, live] = table[trans[:, live], byte[live]]
        self.trans = trans  # [NUM_STATES, V] int8
        self.masks = from_bool(torch.from_numpy(trans != REJECT))  # [NUM_STATES, W] int32

    def next(self, state: int, token: int) -> int:
        return int(self.trans[state, token])
