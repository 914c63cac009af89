"""Frozen fp32 linear layers through oneDNN (`masgraph/backends/hf/onednn.py`): the same numbers as `F.linear` up to
fp32 summation order, the input's gradient too, and the calls really go to oneDNN once installed."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from masgraph.backends.hf import onednn
from masgraph.errors import MasgraphError

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


@pytest.fixture
def kernel(monkeypatch):
    """Force the kernel by the environment (the measured choice is this machine's, either way)."""
    def force(name: str) -> None:
        monkeypatch.setenv(onednn.ENV, name)
        onednn.kernel.cache_clear()
    yield force
    onednn.kernel.cache_clear()


class _Ops(TorchDispatchMode):
    """The names of the ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _frozen(n_in: int, n_out: int, bias: bool) -> torch.nn.Linear:
    layer = torch.nn.Linear(n_in, n_out, bias=bias)
    layer.requires_grad_(False)
    return layer


@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_input_gradient_match_f_linear(kernel, shape, bias):
    kernel("onednn")
    torch.manual_seed(0)
    layer = _frozen(48, 96, bias)
    x = torch.randn(*shape, requires_grad=True)
    grad_out = torch.randn(*shape[:-1], 96)
    got = onednn.linear(x, layer.weight, layer.bias)
    (got_grad,) = torch.autograd.grad(got, x, grad_out)
    want = F.linear(x, layer.weight, layer.bias)
    (want_grad,) = torch.autograd.grad(want, x, grad_out)
    # fp32 sums of 48 (96 for the gradient) products of unit-scale values, in another order: a few ulps of ~10
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-5)


def test_an_installed_model_runs_its_frozen_layers_through_onednn_forward_and_backward(kernel):
    kernel("onednn")
    model = torch.nn.Sequential(_frozen(16, 32, True), torch.nn.SiLU(), _frozen(32, 8, False))
    assert onednn.install(model) == 2
    assert onednn.install(model) == 0  # once only
    x = torch.randn(4, 16, requires_grad=True)
    with _Ops() as ops:
        model(x).sum().backward()
    assert "mkldnn._linear_pointwise" in ops.names
    assert not ops.names & {"aten.mm", "aten.addmm", "aten.linear"}, ops.names
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert onednn.uninstall(model) == 2
    with _Ops() as ops:
        model(x).sum().backward()
    assert "mkldnn._linear_pointwise" not in ops.names


def test_blas_leaves_the_model_alone(kernel):
    kernel("blas")
    model = torch.nn.Sequential(_frozen(16, 32, True))
    assert onednn.install(model) == 0
    with _Ops() as ops:
        model(torch.randn(2, 16))
    assert "mkldnn._linear_pointwise" not in ops.names


def test_trainable_weights_and_autocast_keep_f_linear(kernel):
    kernel("onednn")
    trainable = torch.nn.Linear(16, 8)
    x = torch.randn(2, 16)
    with _Ops() as ops:
        onednn.linear(x, trainable.weight, trainable.bias).sum().backward()
        onednn.linear(x.bfloat16(), trainable.weight.detach().bfloat16().requires_grad_())
        frozen = _frozen(16, 8, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert onednn.linear(x, frozen.weight, frozen.bias).dtype == torch.bfloat16  # as F.linear under autocast
    assert "mkldnn._linear_pointwise" not in ops.names
    assert trainable.weight.grad is not None  # the weight's gradient still flows


def test_a_bad_setting_is_a_clear_error(kernel):
    kernel("mkl")
    with pytest.raises(MasgraphError, match="MASGRAPH_LINEAR='mkl': expected one of"):
        onednn.kernel()


def test_the_measured_choice_is_kept_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv(onednn.ENV, raising=False)
    monkeypatch.setenv("MASGRAPH_CACHE", str(tmp_path))
    monkeypatch.setattr(onednn, "_measure", lambda: "blas")
    onednn.kernel.cache_clear()
    try:
        assert onednn.kernel() == "blas"
        assert list(json.loads((tmp_path / "linear-kernel.json").read_text()).values()) == ["blas"]

        def boom() -> str:
            raise AssertionError("measured twice")
        monkeypatch.setattr(onednn, "_measure", boom)
        onednn.kernel.cache_clear()
        assert onednn.kernel() == "blas"  # read back, not measured
    finally:
        onednn.kernel.cache_clear()


def test_measuring_leaves_the_callers_seed_alone():
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    assert onednn._measure(reps=5) in onednn.KERNELS
    assert torch.equal(torch.rand(4), want)


def test_a_frozen_weight_runs_from_one_packed_copy_kept_until_the_weight_changes(kernel):
    kernel("onednn")
    torch.manual_seed(0)
    layer = _frozen(48, 96, True)
    x = torch.randn(5, 48)
    copy = onednn.packed(layer.weight)
    assert copy is not layer.weight and copy.layout == torch._mkldnn  # oneDNN's own blocked layout
    assert onednn.packed(layer.weight) is copy  # made once
    seen = []
    real = onednn._onednn
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onednn, "_onednn", lambda x, w, b: seen.append(w) or real(x, w, b))
        got = onednn.linear(x, layer.weight, layer.bias)
        onednn.linear(x.requires_grad_(), layer.weight, layer.bias).sum().backward()  # the forward of a gradient pass
        many = torch.randn(onednn.PACK_ROWS + 1, 48)
        onednn.linear(many, layer.weight, layer.bias)  # a pass over many rows: the plain weight, no reorder to save
    assert seen[0] is copy and seen[1] is copy
    assert seen[-1] is layer.weight
    assert torch.equal(real(many, copy, layer.bias), real(many, layer.weight, layer.bias))  # either way, one kernel
    assert torch.equal(got, real(x.detach(), layer.weight, layer.bias))  # the same kernel: the same numbers
    layer.weight.mul_(2.0)  # an in-place change (a load into the weight): the copy is made again from the new values
    torch.testing.assert_close(onednn.linear(x.detach(), layer.weight, layer.bias),
                               F.linear(x.detach(), layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert onednn.packed(layer.weight) is not copy
    key = id(layer.weight)
    seen.clear()
    del layer, copy
    assert key not in onednn._packs  # dropped with its weight


def test_no_packed_copy_without_memory_to_spare_or_for_a_transposed_view(kernel, monkeypatch):
    kernel("onednn")
    layer = _frozen(16, 8, False)
    view = layer.weight.t()  # a new view each call: nothing to keep a copy by
    assert onednn.packed(view) is view
    monkeypatch.setattr(onednn, "_available_bytes", lambda: onednn.HEADROOM)  # nothing beyond the headroom
    assert onednn.packed(layer.weight) is layer.weight
    x = torch.randn(3, 16)
    torch.testing.assert_close(onednn.linear(x, layer.weight), F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn.bf16_through_onednn(), reason="this CPU does not run bf16 through oneDNN")
def test_a_frozen_bf16_layer_reads_its_packed_weight_at_a_few_rows_with_f_linears_very_numbers(kernel):
    kernel("blas")  # the fp32 choice does not decide bf16
    torch.manual_seed(0)
    layer = _frozen(48, 96, True).bfloat16()
    model = torch.nn.Sequential(layer)
    assert onednn.install(model, torch.bfloat16) == 1
    few, many = torch.randn(3, 48).bfloat16(), torch.randn(onednn.PACK_ROWS + 1, 48).bfloat16()
    seen = []
    real = onednn._onednn
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(onednn, "_onednn", lambda x, w, b: seen.append(w) or real(x, w, b))
        got = model(few)
        model(many)  # many rows: F.linear (no reorder worth a copy)
        model(few.requires_grad_()).float().sum().backward()  # a gradient pass: F.linear and autograd
    assert len(seen) == 1 and seen[0] is onednn.packed(layer.weight) and seen[0].layout == torch._mkldnn
    assert torch.equal(got, F.linear(few.detach(), layer.weight, layer.bias))  # bit for bit
    assert few.grad is not None
    assert onednn.install(torch.nn.Sequential(_frozen(4, 4, False).half()), torch.float16) == 0
