"""Selected-token log-probs (`masgraph/backends/hf/logprobs.py`): chunked over tokens, they equal the full-vocabulary
fp32 `log_softmax` + gather to fp32 rounding, values and gradients, and an update (`sequence_logprobs` + backward)
never creates a (rows x tokens x vocabulary) tensor, which the full-vocabulary path does (the watcher sees it).

Tolerances. A log-prob is at most ~40 in magnitude here (the function test's peaked softmax; ~8 = log V on the
models), where fp32's spacing is 3.8e-6. Both paths run the same fp32 log_softmax per token; they differ only in
how the head's matmul is blocked (over other row counts: a few ulps on a logit) and, on the trainable-head path,
in the order autograd sums: atol 2e-5 on values (~5 ulps at 40; measured <= 1.9e-6, and 0 on the model-level tests).
Gradients are sums over V terms and over tokens in another order: rtol 1e-5 of the largest entry of the reference
gradient (measured <= 8.2e-7)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from masgraph.backends.hf import logprobs as lp_module
from masgraph.backends.hf.layout import left_pad, prefill
from masgraph.backends.hf.learner import sequence_logprobs
from masgraph.backends.hf.logprobs import Head, check_head, model_head, selected_logprobs
from masgraph.learn.packing import common_prefix as shared_prefix_len

V = 4096  # big enough that a (rows x tokens x V) tensor stands out from every other tensor of the update
VALUE_ATOL = 2e-5
GRAD_RTOL = 1e-5


@dataclass
class TRow:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float = 1.0
    extra: dict = field(default_factory=dict)


def _full_vocabulary_logprobs(model, rows: Sequence[TRow], pad_id: int, share_prefix: bool = True):
    """The learner's logprob pass before chunking (kept here only as the reference and as the watcher's positive
    control): (B, K+1, V) logits, then a (B, K, V) fp32 log_softmax, then a gather."""
    device = model.device
    seqs = [r.prompt_ids + r.completion_ids for r in rows]
    P = shared_prefix_len(seqs, min(len(r.prompt_ids) for r in rows) - 1) if len(rows) > 1 and share_prefix else 0
    B, K = len(seqs), max(len(r.completion_ids) for r in rows)
    ids, mask, pos = left_pad(P, [s[P:] for s in seqs], pad_id, device)
    cache = None
    if P:
        cache = prefill(model, seqs[0][:P])
        cache.batch_repeat_interleave(B)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=cache is not None, logits_to_keep=K + 1).logits
    temps = torch.tensor([r.temperature for r in rows], device=device)[:, None, None]
    logp = torch.log_softmax(logits[:, :-1].float() / temps, -1)
    targets = torch.tensor([[0] * (K - len(r.completion_ids)) + list(r.completion_ids) for r in rows],
                           dtype=torch.long, device=device)
    picked = logp.gather(-1, targets[:, :, None])[:, :, 0]
    return [picked[i, K - len(r.completion_ids):] for i, r in enumerate(rows)]


def _reference(hidden, head: Head, targets, temps):
    return torch.log_softmax(lp_module.logits_of(head, hidden).float() / temps[:, None], -1).gather(
        -1, targets[:, None])[:, 0]


def _close_grads(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().item()
        assert scale > 0
        assert (g - w).abs().max().item() <= GRAD_RTOL * scale, ((g - w).abs().max().item(), scale)


@pytest.mark.parametrize("softcap,scale", [(None, 1.0), (3.0, 1.0), (None, 0.25)])
@pytest.mark.parametrize("trainable_head", [False, True])
def test_chunked_values_and_gradients_equal_the_full_log_softmax(softcap, scale, trainable_head):
    gen = torch.Generator().manual_seed(0)
    N, H = 37, 16
    lin = torch.nn.Linear(H, V, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(V, H, generator=gen))  # logits of std ~4: a peaked softmax, as a trained LM's
        lin.bias.copy_(torch.randn(V, generator=gen))
    lin.requires_grad_(trainable_head)  # frozen: the fused-gradient path; trainable: the checkpointed one
    head = Head(None, lin, softcap, scale)
    hidden = torch.randn(N, H, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    temps = torch.rand(N, generator=gen) + 0.5
    upstream = torch.randn(N, generator=gen)  # a loss that weighs tokens differently, as PPO's does

    def run(fn):
        h = hidden.clone().requires_grad_(True)
        out = fn(h)
        params = [h, *(p for p in lin.parameters() if p.requires_grad)]
        return out.detach(), torch.autograd.grad((out * upstream).sum(), params)

    want, want_grads = run(lambda h: _reference(h, head, targets, temps))
    for chunk in (1, 5, 37, None):
        got, got_grads = run(lambda h, c=chunk: selected_logprobs(h, head, targets, temps, chunk_tokens=c))
        assert got.dtype == torch.float32 and got.shape == (N,)
        assert (got - want).abs().max().item() <= VALUE_ATOL
        _close_grads(got_grads, want_grads)
        with torch.no_grad():  # the reference pass and the recorded-logprob checks: same values, no graph
            assert torch.equal(selected_logprobs(hidden, head, targets, temps, chunk_tokens=chunk), got)


def _tiny_peft(vocab: int = V, arch: str = "llama", seed: int = 0, targets: Sequence[str] = ("q_proj", "v_proj")):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0,
                                  **({"final_logit_softcapping": 0.1} if arch == "gemma2" else {}))
    model = get_peft_model(AutoModelForCausalLM.from_config(config).eval(),
                           LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)), adapter_name="pol")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a LoRA that changes the output (a fresh one is zero-effect)
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def _rows(seed: int, n: int = 4, shared: int = 12, completion: int = 24, vocab: int = V) -> list[TRow]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab, (shared,), generator=gen).tolist()
    rows = []
    for i in range(n):
        own = torch.randint(1, vocab, (3 + 2 * i,), generator=gen).tolist()
        comp = torch.randint(1, vocab, (completion - 3 * i,), generator=gen).tolist()  # ragged: left padding
        rows.append(TRow(prefix + own, comp, temperature=[1.0, 0.7, 1.3, 0.9][i % 4]))
    return rows


@pytest.mark.parametrize("arch,targets", [
    ("llama", ("q_proj", "v_proj")),  # a tied, frozen head: the fused-gradient path
    ("llama", ("q_proj", "lm_head")),  # a LoRA on the head itself: the checkpointed path
    ("gemma2", ("q_proj", "v_proj")),  # soft-capped logits
    ("phi", ("q_proj", "v_proj")),  # a biased head
])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_sequence_logprobs_equals_the_full_vocabulary_path(arch, targets, share_prefix):
    model = _tiny_peft(arch=arch, targets=targets)
    check_head(model, model_head(model))
    rows = _rows(1)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    upstream = torch.randn(sum(len(r.completion_ids) for r in rows), generator=torch.Generator().manual_seed(3))

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(model, rows, 0, share_prefix=share_prefix)
        (torch.cat(out) * upstream).sum().backward()
        return [o.detach() for o in out], [p.grad.clone() for p in lora]

    want, want_grads = run(_full_vocabulary_logprobs)
    got, got_grads = run(lambda *a, **k: sequence_logprobs(*a, **k, chunk_tokens=7))
    assert [g.shape for g in got] == [w.shape for w in want] == [(len(r.completion_ids),) for r in rows]
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) <= VALUE_ATOL
    _close_grads(got_grads, want_grads)
    with torch.no_grad(), model.disable_adapter():  # the reference pass: adapters off
        base_want = _full_vocabulary_logprobs(model, rows, 0, share_prefix)
        base_got = sequence_logprobs(model, rows, 0, share_prefix)
    assert max((g - w).abs().max().item() for g, w in zip(base_got, base_want)) <= VALUE_ATOL
    assert max((g - w).abs().max().item() for g, w in zip(base_got, got)) > 1e-3  # the LoRA does change them


class LargestTensor(TorchDispatchMode):
    """Records every tensor an aten op returns (forward and backward) with at least `limit` elements."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.seen, self.ops = limit, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def _watched_update(fn, model, rows) -> LargestTensor:
    B, K = len(rows), max(len(r.completion_ids) for r in rows)
    watch = LargestTensor(B * K * V)
    model.train()
    with watch:
        out = fn(model, rows, 0)
        loss = sum((lp * (i + 1)).sum() for i, lp in enumerate(out))
        before = watch.ops
        loss.backward()
    model.eval()
    assert watch.ops > before + 10  # the backward pass ran under the watcher too
    return watch


def test_an_update_never_creates_a_rows_x_tokens_x_vocabulary_tensor(monkeypatch):
    # a 64K-logit chunk budget: 16 tokens a chunk at V = 4096, so the 4 x 64 completion tokens take 16 chunks
    monkeypatch.setattr(lp_module, "CHUNK_ELEMENTS", 1 << 16)
    model = _tiny_peft()
    rows = _rows(2, n=4, completion=64)
    rows = [TRow(r.prompt_ids, r.completion_ids + [5] * (64 - len(r.completion_ids)), r.temperature) for r in rows]
    assert _watched_update(sequence_logprobs, model, rows).seen == []
    # the watcher's positive control: the full-vocabulary path builds them (logits, log_softmax, its backward)
    seen = _watched_update(_full_vocabulary_logprobs, model, rows).seen
    assert any("log_softmax" in op for op, _ in seen) and any("log_softmax_backward" in op for op, _ in seen), seen


def test_check_head_refuses_a_head_that_is_not_the_models_own():
    from masgraph.errors import MasgraphError

    model = _tiny_peft(arch="gemma2")
    head = model_head(model)
    assert head.softcap == 0.1 and head.scale == 1.0
    check_head(model, head)
    for wrong in (head._replace(softcap=None), head._replace(scale=2.0)):  # an unknown transform of the logits
        with pytest.raises(MasgraphError, match="differ from the model's own logits"):
            check_head(model, wrong)
