"""The plugin's column-major float32 weights (sloserve/sglang_ext/cpu_weights.py), in the main
environment: values, shapes and Parameter objects kept, each weight once, only float32 CPU
matrices of linear layers and the LM head; the switch and the profile key that follows it.
That SGLang's own server decodes with them exactly as transformers does, and that they are
applied there (the count in its log), is test_smollm2_sglang.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sloserve.cli.sglang_launch import sglang_args
from sloserve.runtime.models.cpu_linear import packed_linear_available
from sloserve.sglang_ext import settings
from sloserve.sglang_ext.cpu_weights import (
    DRAFT_DTYPE_ENV,
    LAYOUT_ENV,
    Bf16Linear,
    PackedF32Method,
    bf16_draft_linears,
    column_major,
    draft_dtype_from_env,
    is_column_major,
    layout_from_env,
    pack_linear_weights,
    relayout_linear_weights,
)


class UnquantizedLinearMethod:
    """Stands in for SGLang's class of that name (the outside world here): a module whose
    quant_method is one multiplies F.linear(x, module.weight)."""


class Linear(torch.nn.Module):
    def __init__(self, n: int, k: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k, dtype=dtype), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class TiedModel(torch.nn.Module):
    """An embedding tied to the LM head (SmolLM2's layout), two linears, a bf16 one, a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.up, self.down = Linear(24, 8), Linear(8, 24)
        self.bf16 = Linear(16, 8, torch.bfloat16)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(ids))
        h = h + self.down(torch.relu(self.up(h)))
        return h @ self.lm_head.weight.T


def test_column_major_keeps_values_and_shape():
    w = torch.randn(48, 16)
    c = column_major(w)
    assert c.shape == w.shape and c.stride() == (1, 48) and torch.equal(c, w)
    assert is_column_major(c) and not is_column_major(w)
    x = torch.randn(5, 16)
    torch.testing.assert_close(F.linear(x, c), F.linear(x, w))


def test_relayout_changes_linears_and_the_tied_head_once_in_place():
    torch.manual_seed(0)
    model = TiedModel()
    ids = torch.tensor([[3, 7, 49, 0, 12]])
    before = model(ids)
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}

    assert relayout_linear_weights(model) == 3  # up, down, the tied head; not the bf16 one
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, values[name])  # same objects and values
    assert is_column_major(model.up.weight) and is_column_major(model.down.weight)
    assert is_column_major(model.embed.weight) and model.lm_head.weight is model.embed.weight
    assert model.bf16.weight.is_contiguous() and model.norm.weight.is_contiguous()
    torch.testing.assert_close(model(ids), before)  # lookups and products read any strides
    assert relayout_linear_weights(model) == 0  # done: not contiguous any more
    assert relayout_linear_weights(None) == 0


def test_the_layout_switch_and_the_profile_key_follow_the_environment(monkeypatch):
    monkeypatch.delenv(LAYOUT_ENV, raising=False)
    monkeypatch.setenv(DRAFT_DTYPE_ENV, "float32")
    # auto: oneDNN-packed off Intel's CPUs (where oneDNN runs), column-major on them
    assert layout_from_env(vendor="AuthenticAMD", packable=True) == "packed"
    assert layout_from_env(vendor="GenuineIntel", packable=True) == "column"
    assert layout_from_env(vendor="AuthenticAMD", packable=False) == "column"
    assert layout_from_env() in ("packed", "column")
    monkeypatch.setenv(LAYOUT_ENV, "column")
    assert layout_from_env(vendor="AuthenticAMD", packable=True) == "column"
    assert settings.sglang_device_key("cpu", kernel=False).endswith("-wcol")
    monkeypatch.setenv(LAYOUT_ENV, " Packed")
    assert layout_from_env(vendor="GenuineIntel") == "packed"
    assert settings.sglang_device_key("cpu", kernel=False).endswith("-wpak")
    monkeypatch.setenv(LAYOUT_ENV, "ROW")
    assert layout_from_env() == "row"
    row_key = settings.sglang_device_key("cpu", kernel=False)
    assert row_key.startswith("sglang-cpu-") and not row_key.endswith("-wcol")
    monkeypatch.setenv(LAYOUT_ENV, "transposed")
    with pytest.raises(ValueError, match=LAYOUT_ENV):
        layout_from_env()


def test_the_launcher_refuses_an_unknown_layout(monkeypatch, capsys):
    monkeypatch.setenv(LAYOUT_ENV, "transposed")
    with pytest.raises(SystemExit) as e:
        sglang_args(["--model-path", "/nonexistent", "--spec-policy", "ar"])
    assert e.value.code == 2
    assert LAYOUT_ENV in capsys.readouterr().err


def test_the_layout_benchmark_runs_both_layouts_on_the_same_products(tmp_path):
    import json

    from sloserve.bench.cpu_weights import main, products, weights
    from sloserve.runtime.models.cpu_linear import pack_weight, packed_linear

    stack, head = weights(1)
    x = torch.randn(3, head.shape[1])
    torch.testing.assert_close(
        products(x, [[column_major(w) for w in ws] for ws in stack], column_major(head)),
        products(x, stack, head))
    packed = packed_linear_available()
    if packed:
        torch.testing.assert_close(
            products(x, [[pack_weight(w) for w in ws] for ws in stack], pack_weight(head),
                     packed_linear),
            products(x, stack, head))
    out = tmp_path / "bench.json"
    assert main(["--rows", "1,3", "--layers", "1", "--repeats", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["rows"] for r in results] == [1, 3]
    names = {"row", "column"} | ({"packed"} if packed else set())
    assert all(set(r["ms"]) == names and min(r["ms"].values()) > 0 for r in results)
    with pytest.raises(SystemExit):
        main(["--rows", "0"])
    if not packed_linear_available(torch.bfloat16):  # an AVX2-only CPU: said, not crashed
        with pytest.raises(SystemExit):
            main(["--bf16", "--rows", "2"])
    else:  # the draft's bf16 products: F.linear and the packed copy alike
        bf16, bhead = weights(1, head_rows=64, dtype=torch.bfloat16)
        from sloserve.bench.cpu_weights import _bf16_linear, _bf16_packed
        torch.testing.assert_close(
            products(x, [[pack_weight(w) for w in ws] for ws in bf16], pack_weight(bhead),
                     _bf16_packed),
            products(x, bf16, bhead, _bf16_linear), rtol=0.02, atol=0.02)
        assert main(["--bf16", "--rows", "2", "--layers", "1", "--head-rows", "64",
                     "--repeats", "1", "--out", str(out)]) == 0
        assert set(json.loads(out.read_text())["results"][0]["ms"]) == {"row", "packed"}


def test_the_draft_dtype_switch_and_its_profile_key(monkeypatch):
    monkeypatch.setenv(LAYOUT_ENV, "column")
    monkeypatch.delenv(DRAFT_DTYPE_ENV, raising=False)
    assert draft_dtype_from_env(bf16_hardware=True) == "bfloat16"  # auto: the CPU decides
    assert draft_dtype_from_env(bf16_hardware=False) == "float32"
    monkeypatch.setenv(DRAFT_DTYPE_ENV, "bfloat16")
    assert settings.sglang_device_key("cpu", kernel=False).endswith("-wcol-dbf16")
    # the n-gram drafter runs no draft forward: its profiles keep the key without it
    assert settings.sglang_device_key("cpu", draft_model=False, kernel=False).endswith("-wcol")
    monkeypatch.setenv(DRAFT_DTYPE_ENV, " Float32 ")
    assert draft_dtype_from_env(bf16_hardware=True) == "float32"
    assert settings.sglang_device_key("cpu", kernel=False).endswith("-wcol")
    monkeypatch.setenv(DRAFT_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match=DRAFT_DTYPE_ENV):
        draft_dtype_from_env()
    with pytest.raises(SystemExit) as e:
        sglang_args(["--model-path", "/nonexistent", "--spec-policy", "ar"])
    assert e.value.code == 2


class QuantLinear(torch.nn.Module):
    """A linear layer as SGLang's: forward through its quant method's apply."""

    def __init__(self, n: int, k: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(n), requires_grad=False) if bias else None
        self.quant_method = UnquantizedLinearMethod()
        self.quant_method.apply = lambda layer, x, bias=None: F.linear(x, layer.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class DraftModel(torch.nn.Module):
    """A tied embedding and LM head, linears through their quant methods (one with a bias,
    one packed for SGLang's AMX kernels), a bf16 one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.qkv, self.o = QuantLinear(24, 8, bias=True), QuantLinear(8, 24)
        self.o.use_intel_amx_backend = True
        self.bf16 = Linear(16, 8, torch.bfloat16)
        self.lm_head = self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.o(torch.relu(self.qkv(h)))
        return h @ self.lm_head.weight.T


def test_bf16_draft_linears_multiply_in_bf16_and_answer_in_float32():
    torch.manual_seed(0)
    model = DraftModel()
    x, ids = torch.randn(5, 8), torch.tensor([[3, 7, 49]])
    before, logits = model.qkv(x), model(ids)

    assert bf16_draft_linears(model) == 1  # qkv; not the AMX-packed o, the bf16 one, the head
    assert model.qkv.weight.dtype == torch.bfloat16 and model.qkv.weight.is_contiguous()
    assert model.qkv.bias.dtype == torch.bfloat16
    assert isinstance(model.qkv.quant_method, Bf16Linear)
    assert model.o.weight.dtype == torch.float32 and model.embed.weight.dtype == torch.float32
    # oneDNN's prepacked copy of the bf16 weight where torch has the packed linear
    assert ((model.qkv.quant_method.packed is not None)
            == packed_linear_available(torch.bfloat16))
    after = model.qkv(x)
    assert after.dtype == torch.float32
    expected = F.linear(x.bfloat16(), model.qkv.weight, model.qkv.bias).float()
    # the packed product sums in oneDNN's order: bf16 roundings apart from F.linear's at most
    torch.testing.assert_close(after, expected, rtol=0.02, atol=0.02)
    unpacked = Bf16Linear(model.qkv.quant_method.inner)  # no packed copy: F.linear itself
    assert torch.equal(unpacked.apply(model.qkv, x, model.qkv.bias), expected)
    lead = torch.randn(2, 3, 8)  # leading dimensions kept
    assert model.qkv(lead).shape == (2, 3, 24)
    torch.testing.assert_close(model.qkv(lead)[1], model.qkv(lead[1]))
    # bf16 inputs and weights: about 3 significant digits, not the float32 result itself
    torch.testing.assert_close(after, before, rtol=0.05, atol=0.1)
    assert not torch.equal(after, before)
    out = model(ids)  # the residual stream and the head stay float32
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, logits, rtol=0.05, atol=0.5)
    assert bf16_draft_linears(model) == 0  # done
    assert bf16_draft_linears(None) == 0


@pytest.mark.skipif(not packed_linear_available(), reason="torch without oneDNN's packed linear")
def test_packed_linears_and_tied_head_give_the_same_products():
    torch.manual_seed(0)
    model = DraftModel()
    x, ids = torch.randn(2, 5, 8), torch.tensor([[3, 7, 49]])
    before, logits = model.qkv(x), model(ids)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}

    model.lm_head = HeadEmbedding(model.embed)  # the tied head as SGLang's: a quant method
    assert pack_linear_weights(model) == 2  # qkv and the head; not the AMX o, the bf16 one
    assert pack_linear_weights(model) == 0 and pack_linear_weights(None) == 0  # done
    assert isinstance(model.qkv.quant_method, PackedF32Method)
    assert isinstance(model.lm_head.quant_method, PackedF32Method)
    assert type(model.o.quant_method).__name__ == "UnquantizedLinearMethod"
    for name, p in model.named_parameters():  # a packed linear's weight is freed, the rest kept
        if name == "qkv.weight":
            assert p.shape == weights[name].shape and p.stride() == (0, 0)
            assert p.untyped_storage().nbytes() == 4 and p.isnan().all()
            torch.testing.assert_close(model.qkv.quant_method.dense(), weights[name],
                                       rtol=0, atol=0)
        else:
            assert torch.equal(p, weights[name]) and p.is_contiguous()
    after = model.qkv(x)  # [2, 5, 24] through the packed copy, bias added
    assert after.shape == before.shape
    torch.testing.assert_close(after, before)  # float32 products, summed in oneDNN's order
    torch.testing.assert_close(model(ids), logits)
    h = torch.randn(3, 8)
    head = model.lm_head.quant_method.apply(model.lm_head, h)  # the logits processor's call
    torch.testing.assert_close(head, h @ model.embed.weight.T)
    assert model.lm_head.quant_method.embedding(model.lm_head, ids).shape == (1, 3, 8)
    # the draft's bf16 linears replace a packed float32 method by their own
    assert bf16_draft_linears(model) == 1  # the values back from the packed copy
    assert torch.equal(model.qkv.weight, weights["qkv.weight"].bfloat16())
    assert isinstance(model.qkv.quant_method, Bf16Linear)
    assert type(model.qkv.quant_method.inner).__name__ == "UnquantizedLinearMethod"


class UnquantizedEmbeddingMethod:
    """Stands in for SGLang's: an embedding's lookups."""

    def embedding(self, layer: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class HeadEmbedding(torch.nn.Module):
    """SGLang's VocabParallelEmbedding as a tied LM head: the embedding's weight, its lookups
    through its quant method."""

    def __init__(self, embed: torch.nn.Embedding) -> None:
        super().__init__()
        self.weight = embed.weight
        self.quant_method = UnquantizedEmbeddingMethod()
