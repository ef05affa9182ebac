"""The SPECSERVE draft's KV book (sloserve/sglang_ext/draft_kv.py), SGLang-free: which
positions a catch-up must read after steps that drafted nothing, the tokens it reads, and
holes in a prefix that SGLang's radix cache hands to a new request."""

from __future__ import annotations

import torch

from sloserve.sglang_ext.draft_kv import DraftKVBook


def _book() -> DraftKVBook:
    # rows 0..3, context 32; row r's position p sits in KV slot 1 + 32 r + p (slot 0 unused)
    req_to_token = (1 + torch.arange(4 * 32, dtype=torch.int32)).reshape(4, 32)
    return DraftKVBook(req_to_token, 1 + 4 * 32)


def _prefill(book: DraftKVBook, row: int, ids: list[int], prefix: int = 0) -> None:
    book.written(book.req_to_token[row, prefix:len(ids)])
    book.prefilled([row], [prefix], [ids])


def test_nothing_to_read_until_a_step_skips():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    assert book.catch_up([0, 1], [3, 2]) is None
    # a drafting step verifies [b, d1, d2] at L..L + 2 and the draft reads them
    book.decoded(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([[10, 11, 12],
                                                                           [20, 21, 22]]))
    assert book.catch_up([0, 1], [5, 3]) is None


def test_skipped_positions_are_read_once_with_their_tokens():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    book.decoded(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([[10, 11],
                                                                           [20, 21]]))
    # row 0 committed 10, 11 (L 3 -> 5); row 1 committed 20 (L 2 -> 3)
    book.skipped([0, 1], [5, 3], torch.tensor([30, 40]))
    book.skipped([0, 1], [6, 4], torch.tensor([31, 41]))
    starts = book.catch_up([0, 1], [7, 5])
    assert starts == [5, 3]
    tokens, slots = book.window([0, 1], starts, [7, 5])
    assert tokens.tolist() == [30, 31, 40, 41]
    assert slots.tolist() == [1 + 5, 1 + 6, 33 + 3, 33 + 4]
    book.written(slots)
    book.caught_up([0, 1])
    assert book.catch_up([0, 1], [7, 5]) is None


def test_a_request_without_gaps_rereads_its_last_committed_token():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    book.decoded(torch.tensor([0]), torch.tensor([3]), torch.tensor([[10, 11]]))
    book.skipped([1], [2], torch.tensor([40]))  # row 1 alone skipped a step
    starts = book.catch_up([0, 1], [4, 3])
    assert starts == [3, 2]
    tokens, _ = book.window([0, 1], starts, [4, 3])
    assert tokens.tolist() == [10, 40]  # row 0's position 3 holds 10: the same KV again


def test_a_cached_prefix_with_skipped_slots_is_read_by_its_new_owner():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    book.skipped([0], [3], torch.tensor([30]))
    book.skipped([0], [4], torch.tensor([31]))
    # row 0 finishes; its slots go to the radix cache and row 2 starts with all five as its
    # prefix (SGLang copies the slot numbers into row 2) and one new token
    book.req_to_token[2, :5] = book.req_to_token[0, :5]
    _prefill(book, 2, [5, 6, 7, 30, 31, 50], prefix=5)
    starts = book.catch_up([2], [6])
    assert starts == [3]
    tokens, slots = book.window([2], starts, [6])
    assert tokens.tolist() == [30, 31, 50]
    assert slots[:2].tolist() == book.req_to_token[0, 3:5].tolist()
    # a prefix without such slots has nothing to read
    book.written(slots)
    book.req_to_token[3, :5] = book.req_to_token[0, :5]
    _prefill(book, 3, [5, 6, 7, 30, 31, 60], prefix=5)
    assert book.catch_up([3], [6]) is None


def test_a_reused_row_forgets_its_previous_owner():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    book.skipped([0], [3], torch.tensor([30]))
    _prefill(book, 0, [1, 2])  # the row's request ended; a new one prefilled into it
    assert book.catch_up([0], [2]) is None
