"""The SPECSERVE draft's KV book (sloserve/sglang_ext/draft_kv.py), SGLang-free: which
positions a catch-up must read (prompts the draft has not read, steps that drafted nothing,
holes in a prefix that SGLang's radix cache hands to a new request) and the tokens it reads
with each request's bonus token."""

from __future__ import annotations

import torch

from sloserve.sglang_ext.draft_kv import DraftKVBook


def _book() -> DraftKVBook:
    # rows 0..3, context 32; row r's position p sits in KV slot 1 + 32 r + p (slot 0 unused)
    req_to_token = (1 + torch.arange(4 * 32, dtype=torch.int32)).reshape(4, 32)
    return DraftKVBook(req_to_token, 1 + 4 * 32)


def _prefill(book: DraftKVBook, row: int, ids: list[int], prefix: int = 0) -> None:
    """The target prefilled ids[prefix:] into row (the draft reads nothing at prefill)."""
    book.unread(book.req_to_token[row, prefix:len(ids)])
    book.prefilled([row], [ids])


def _skipped(book: DraftKVBook, rows: list[int], positions: list[int],
             tokens: torch.Tensor) -> None:
    """A step without drafting committed tokens[i] at positions[i] of row rows[i]: a verify
    of the bonus alone (the worker's path: `verified` with a one-token window)."""
    book.verified(rows, positions, tokens.reshape(-1, 1))


def _first_round(book: DraftKVBook, rows: list[int], lens: list[int],
                 bonus: list[int]) -> tuple[list[int] | None, list[int]]:
    """What a drafting step's first round reads (starts, tokens), marking it read."""
    starts = book.catch_up(rows, lens)
    if starts is None:
        return None, []
    book.bonus(rows, lens, torch.tensor(bonus))
    tokens, slots = book.window(rows, starts, [n + 1 for n in lens])
    book.written(slots)
    book.caught_up(rows)
    return starts, tokens.tolist()


def test_a_prompt_is_read_with_the_first_round_that_drafts():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    starts, tokens = _first_round(book, [0, 1], [3, 2], [10, 20])
    assert starts == [0, 0]
    assert tokens == [5, 6, 7, 10, 8, 9, 20]  # each prompt, then its bonus token
    # the round read the bonus; a drafting step verifies [b, d1, d2] and the draft reads it
    book.decoded(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([[10, 11, 12],
                                                                           [20, 21, 22]]))
    assert book.catch_up([0, 1], [5, 3]) is None


def test_skipped_positions_are_read_once_with_their_tokens():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    _first_round(book, [0, 1], [3, 2], [10, 20])
    book.decoded(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([[10, 11],
                                                                           [20, 21]]))
    # row 0 committed 10, 11 (L 3 -> 5); row 1 committed 20 (L 2 -> 3)
    _skipped(book, [0, 1], [5, 3], torch.tensor([30, 40]))
    _skipped(book, [0, 1], [6, 4], torch.tensor([31, 41]))
    starts = book.catch_up([0, 1], [7, 5])
    assert starts == [5, 3]
    book.bonus([0, 1], [7, 5], torch.tensor([32, 42]))
    tokens, slots = book.window([0, 1], starts, [8, 6])
    assert tokens.tolist() == [30, 31, 32, 40, 41, 42]
    assert slots.tolist() == [1 + 5, 1 + 6, 1 + 7, 33 + 3, 33 + 4, 33 + 5]
    book.written(slots)
    book.caught_up([0, 1])
    assert book.catch_up([0, 1], [8, 6]) is None


def test_a_request_without_gaps_reads_only_its_bonus_token():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    _first_round(book, [0, 1], [3, 2], [10, 20])
    book.decoded(torch.tensor([0]), torch.tensor([3]), torch.tensor([[10, 11]]))
    _skipped(book, [1], [2], torch.tensor([40]))  # row 1 alone skipped a step
    starts, tokens = _first_round(book, [0, 1], [5, 3], [12, 41])
    assert starts == [5, 2]
    assert tokens == [12, 40, 41]  # row 0: its bonus alone (one row: round 1's)


def test_a_cached_prefix_with_unread_slots_is_read_by_its_new_owner():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _first_round(book, [0], [3], [30])
    _skipped(book, [0], [3], torch.tensor([30]))
    _skipped(book, [0], [4], torch.tensor([31]))
    # row 0 finishes; its slots go to the radix cache and row 2 starts with all five as its
    # prefix (SGLang copies the slot numbers into row 2) and one new token
    book.req_to_token[2, :5] = book.req_to_token[0, :5]
    _prefill(book, 2, [5, 6, 7, 30, 31, 50], prefix=5)
    starts, tokens = _first_round(book, [2], [6], [51])
    assert starts == [3]
    assert tokens == [30, 31, 50, 51]
    # a prefix without such slots: only the new chunk is read
    book.req_to_token[3, :5] = book.req_to_token[0, :5]
    _prefill(book, 3, [5, 6, 7, 30, 31, 60], prefix=5)
    starts, tokens = _first_round(book, [3], [6], [61])
    assert starts == [5]
    assert tokens == [60, 61]


def test_a_request_never_drafted_for_reads_nothing_and_a_reused_row_forgets_its_owner():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _skipped(book, [0], [3], torch.tensor([30]))  # decoded without drafting, then finished
    assert book.catch_up([1], [2]) is None  # others' steps never read row 0
    _prefill(book, 0, [1, 2])  # a new request prefilled into the row
    starts, tokens = _first_round(book, [0], [2], [3])
    assert starts == [0]
    assert tokens == [1, 2, 3]


def test_after_a_drafting_step_only_the_last_drafted_position_can_be_missing():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    _first_round(book, [0, 1], [3, 2], [10, 20])
    # two rounds wrote b, d1 at L, L + 1; the step verified [b, d1, d2] at L..L + 2
    book.verified([0, 1], [3, 2], torch.tensor([[10, 11, 12], [20, 21, 22]]))
    # row 0 accepted both drafts (L 3 -> 6, d2 at 5 has no draft KV); row 1 accepted none
    # (L 2 -> 3: its bonus replaces d1 at 3, and position 4 is past its sequence)
    starts, tokens = _first_round(book, [0, 1], [6, 3], [13, 23])
    assert starts == [5, 3]
    assert tokens == [12, 13, 23]


def test_lags_count_what_a_catch_up_would_read_besides_the_bonus():
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    assert book.lags([0, 1], [3, 2]) == [3, 2]  # the prompts
    _first_round(book, [0, 1], [3, 2], [10, 20])
    book.decoded(torch.tensor([0, 1]), torch.tensor([3, 2]), torch.tensor([[10, 11],
                                                                           [20, 21]]))
    assert book.lags([0, 1], [5, 3]) == [0, 0]
    _skipped(book, [0, 1], [5, 3], torch.tensor([30, 40]))
    _skipped(book, [0], [6], torch.tensor([31]))
    assert book.lags([0, 1], [7, 4]) == [2, 1]


def test_a_request_that_does_not_draft_keeps_its_lag():
    """Only the requests that draft the step read what they miss (the policy priced their
    catch-up alone); the others start at their bonus and stay stale."""
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    _prefill(book, 2, [1, 2])
    starts, kept = book.drafters_catch_up([0, 1, 2], [3, 2, 2], [True, False, False])
    assert starts == [0, 2, 2] and kept == [1, 2]
    assert book.drafters_catch_up([0, 1], [3, 2], None) == ([0, 0], [])
    # nobody who drafts misses anything: no catch-up, the others still kept
    book.caught_up([0])
    assert book.drafters_catch_up([0, 1], [3, 2], [True, False]) == (None, [1])
    assert book.lags([0, 1], [3, 2]) == [0, 2]


def test_a_step_without_drafting_after_rejected_drafts_reads_its_bonus_later():
    """Drafts rejected at a step leave the book's mark past the sequence (row 1 below: the
    window reached 4, its sequence ends at 3). A step without drafting then commits a bonus
    at 3, where the draft's KV still holds the rejected d1: the next catch-up must read it
    (with the mark left at 4 it read only the new bonus, and the draft kept the rejected
    token in its context for the rest of the request: a CI run's confidences differed from
    the draft model's by 2% at the end of one request)."""
    book = _book()
    _prefill(book, 0, [5, 6, 7])
    _prefill(book, 1, [8, 9])
    _first_round(book, [0, 1], [3, 2], [10, 20])
    book.verified([0, 1], [3, 2], torch.tensor([[10, 11, 12], [20, 21, 22]]))
    # row 0 accepted both (L 3 -> 6), row 1 none (L 2 -> 3); then a step drafts nothing
    _skipped(book, [0, 1], [6, 3], torch.tensor([13, 23]))
    starts, tokens = _first_round(book, [0, 1], [7, 4], [14, 24])
    assert starts == [5, 3]
    assert tokens == [12, 13, 14, 23, 24]
    assert book.lags([0, 1], [8, 5]) == [0, 0]
