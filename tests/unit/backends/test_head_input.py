"""The output head gets a row-major input: a decode pass's last-position logits (`logits_to_keep=1`) run as one
matrix product, not a batched one over the head's weight copied per row (pytorch/pytorch#151934)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from masgraph.backends.hf.model import HFModel


class _Ops(TorchDispatchMode):
    """The aten ops run, with their tensor operands' (shape, strides)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        operands = [(tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor)]
        self.seen.append((str(func.overloadpacket.__name__), operands))
        return func(*args, **(kwargs or {}))


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(torch.tensor(shape[i + 1:]).prod()) for i in range(len(shape)))


@pytest.mark.parametrize("rows", [1, 3])
def test_last_position_logits_are_one_matrix_product(tiny_model, rows):
    weights = HFModel(str(tiny_model("llama")), dtype="float32")
    model = weights.model
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (rows, 7))
    with torch.inference_mode():
        want = model(input_ids=ids).logits[:, -1, :]
        with _Ops() as ops:
            got = model(input_ids=ids, logits_to_keep=1).logits[:, -1, :]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    head = [operands for name, operands in ops.seen if any(vocab in shape for shape, _ in operands)]
    assert head, "the head's product was not seen"
    # the weight (vocab x hidden) is never expanded per row into a batched product or copied: every op on it takes
    # a row-major input (a strided one, even with rows = 1, sends torch's linear to a batched product)
    for (shape, strides), *_ in head:
        assert strides == _row_major(shape), (shape, strides)
