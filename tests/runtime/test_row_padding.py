"""Padding few-row packed float32 products (cpu_linear.py): the padded product's rows are the
product's, the decision is the machine's one file, read by every later process, and the
variable that overrides it names itself when wrong."""

from __future__ import annotations

import json

import pytest
import torch

from sloserve.runtime.models import cpu_linear
from sloserve.runtime.models.cpu_linear import (
    PAD_ENV,
    PAD_TO,
    machine_padding,
    pack_weight,
    packed_linear,
    packed_linear_available,
    pad_setting,
    padded_row_counts,
)

needs_packed = pytest.mark.skipif(not packed_linear_available(),
                                  reason="no oneDNN packed linear in this torch")


@pytest.fixture
def setting(monkeypatch):
    """Set SLOSERVE_CPU_PAD_ROWS for one test, the process's cached decision dropped
    before and after."""
    def set_(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(PAD_ENV, raising=False)
        else:
            monkeypatch.setenv(PAD_ENV, value)
        padded_row_counts.cache_clear()
    yield set_
    padded_row_counts.cache_clear()


@needs_packed
@pytest.mark.parametrize("rows", [1, 2, 3, 5])
def test_padded_rows_are_the_products_rows(setting, rows):
    torch.manual_seed(rows)
    w, b = torch.randn(96, 1536) * 0.05, torch.randn(96)
    x = torch.randn(rows, 1536)
    packed = pack_weight(w)
    setting("on")
    out = packed_linear(x, packed, b)
    assert out.shape == (rows, 96)
    torch.testing.assert_close(out, x @ w.T + b, rtol=1e-4, atol=1e-4)
    setting("off")
    torch.testing.assert_close(packed_linear(x, packed, b), out, rtol=1e-4, atol=1e-4)


@needs_packed
def test_off_is_the_bare_product_and_on_pads_below_pad_to(setting):
    setting("off")
    assert padded_row_counts() == frozenset()
    torch.manual_seed(0)
    w, x = torch.randn(64, 576), torch.randn(1, 576)
    packed = pack_weight(w)
    bare = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert torch.equal(packed_linear(x, packed), bare)
    setting("on")
    assert padded_row_counts() == frozenset(range(1, PAD_TO))
    padded = torch.cat([x, x.new_zeros(PAD_TO - 1, 576)])
    want = torch.ops.mkldnn._linear_pointwise(padded, packed, None, "none", [], "")[:1]
    assert torch.equal(packed_linear(x, packed), want)  # the padded kernel's own bits


def test_bad_setting_names_the_variable(setting):
    setting("sometimes")
    with pytest.raises(ValueError, match=PAD_ENV):
        pad_setting()


def test_decision_is_measured_once_and_shared(tmp_path):
    path = tmp_path / "cpu" / "pad.json"
    calls = []

    def measure() -> dict[int, float]:  # rows 1 and 2 slower than PAD_TO rows, 3 not
        calls.append(1)
        return {1: 1.0, 2: 1.2, 3: 0.85, 4: 0.8}

    assert machine_padding(path, measure) == frozenset({1, 2})
    assert json.loads(path.read_text())["pad"] == [1, 2]
    assert len(calls) == 2  # two passes that agree
    # a later process reads the file; it never measures again, whatever it would measure
    assert machine_padding(path, lambda: {1: 0.5, 2: 0.5, 3: 0.5, 4: 9.0}) == {1, 2}
    assert len(calls) == 2


def test_passes_that_never_agree_pad_nothing(tmp_path):
    answers = iter([{1: 1.0, 2: 1.0, 3: 1.0, 4: 0.5}, {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0}] * 4)
    assert machine_padding(tmp_path / "pad.json", lambda: next(answers)) == frozenset()


def test_auto_reads_the_machines_file(setting, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = cpu_linear._decision_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pad": [2]}))
    setting(None)
    assert padded_row_counts() == frozenset({2})


def test_no_cache_to_keep_a_decision_in_pads_nothing(setting, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("a file, not a directory: the cache cannot be made under it")
    monkeypatch.setenv("HOME", str(home))
    setting(None)
    assert padded_row_counts() == frozenset()
