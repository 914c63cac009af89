"""Log-probs of selected tokens from a causal LM's final hidden states, never building a (tokens x vocabulary)
tensor larger than one chunk: each chunk of tokens gets its logits (chunk x V, fp32) and their log_softmax, of which the
target's entry is kept, and the backward pass needs no stored logits either.

For a frozen plain `nn.Linear` head (the LoRA case: base weights frozen, tied or not, bias or not) the gradient with
respect to the hidden states is computed in the same pass as the values, as Liger's fused linear cross-entropy does:
d logp_t / d h_t = ((onehot(y_t) - softmax_t) / T_t * cap'_t * scale) @ W is one (H,) vector per token, which the
backward pass only multiplies by the incoming per-token gradient. Any other head (a LoRA-wrapped or trainable head)
runs each chunk under activation checkpointing, so the backward pass recomputes that chunk's logits alone.

`selected_logprobs` is pure (tensors and a module in, a tensor out); `model_head` finds the pieces of a transformers
causal LM (peft-wrapped or not) and `check_head` verifies them against the model's own forward once."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from masgraph.backends.hf import onednn
from masgraph.errors import MasgraphError

CHUNK_ELEMENTS = 1 << 24
"""Default logits per chunk (64 MiB in fp32): 341 tokens at SmolLM2's 49,152 vocabulary, 110 at Qwen's 151,936."""


class Head(NamedTuple):
    """How a causal LM turns final hidden states into logits: `transform(head(hidden))`."""

    backbone: Any
    """The decoder stack (embeddings .. final norm): called like the model, returns `last_hidden_state`."""
    head: torch.nn.Module
    """The output projection (`get_output_embeddings()`: the LM head, possibly tied, biased or LoRA-wrapped)."""
    softcap: float | None
    """Gemma 2/3's `final_logit_softcapping`: logits -> cap * tanh(logits / cap)."""
    scale: float
    """A constant logit multiplier: Cohere's `logit_scale`, Granite's 1 / `logits_scaling`; 1.0 elsewhere."""


def model_head(model: Any) -> Head:
    """The backbone, head and logit transform of a transformers causal LM (or a peft model wrapping one). The LoRA
    layers peft injected live inside those modules, so calling them applies the active adapter (or none, under
    `disable_adapter()`) exactly as the full model's forward does."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = causal.get_output_embeddings()
    if head is None:
        raise MasgraphError(f"{type(causal).__name__} has no output embeddings (LM head); the learner needs a causal "
                            "LM (AutoModelForCausalLM)")
    config = causal.config
    config = getattr(config, "text_config", None) or config  # multimodal wrappers keep the LM's settings there
    scale = float(getattr(config, "logit_scale", None) or 1.0)
    if getattr(config, "logits_scaling", None):
        scale /= float(config.logits_scaling)
    return Head(causal.get_decoder(), head, getattr(config, "final_logit_softcapping", None), scale)


def check_head(model: Any, head: Head, length: int = 4) -> None:
    """Raise MasgraphError unless `head` reproduces `model`'s own logits on a few tokens (an architecture whose
    forward transforms logits in a way `model_head` does not know would otherwise train on wrong log-probs)."""
    ids = torch.arange(1, length + 1, device=model.device)[None]
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        want_dtype, want = want.dtype, want.float()
        got = logits_of(head, head.backbone(input_ids=ids).last_hidden_state[0]).float()
    gap = (want - got).abs().max().item()
    # identical ops give identical logits; a folded scale (Granite's division) may differ by an ulp of the dtype,
    # while an unknown transform (a soft cap, a logit multiplier) differs by far more
    if gap > max(1e-3, 8 * torch.finfo(want_dtype).eps) * (1.0 + want.abs().max().item()):
        raise MasgraphError(f"{type(model).__name__}: the learner's chunked log-probs differ from the model's own "
                            f"logits by {gap:.3g} (its forward transforms logits in a way masgraph does not know); "
                            "fix: report the architecture to masgraph")


def logits_of(head: Head, hidden: torch.Tensor) -> torch.Tensor:
    """`transform(head(hidden))` in the model's dtype, in the order the transformers forward applies it."""
    logits = head.head(hidden)
    if head.scale != 1.0:
        logits = logits * head.scale
    if head.softcap is not None:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    return logits


def selected_logprobs(hidden: torch.Tensor, head: Head | torch.nn.Module, targets: torch.Tensor,
                      temperatures: torch.Tensor | float = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """log softmax(logits_t / T_t)[y_t] for each token t, as an (N,) fp32 tensor, where logits_t are the head's
    (transformed) logits of `hidden[t]` (N, H), y_t = `targets[t]` (N,) and T_t = `temperatures` (N,) or a scalar.

    Equal to `log_softmax(logits.float() / T, -1).gather(-1, y)` up to fp32 rounding, gradients included (to
    `hidden` and to any trainable parameter of the head), but only `chunk_tokens` x V logits exist at a time (default:
    `CHUNK_ELEMENTS` // V tokens). `head` is a `Head` or a bare output module (no logit transform).

    Example:
        >>> lp = selected_logprobs(hidden, model.lm_head, targets, 0.7)   # (N,)
    """
    if not isinstance(head, Head):
        head = Head(None, head, None, 1.0)
    N, V = hidden.shape[0], getattr(head.head, "out_features", None) or head.head.weight.shape[0]
    chunk = max(1, chunk_tokens or CHUNK_ELEMENTS // V)
    temps = torch.as_tensor(temperatures, dtype=torch.float32, device=hidden.device).expand(N)
    targets = targets.to(hidden.device)
    if _frozen_linear(head.head):
        lin = head.head
        return _FrozenLinearLogprobs.apply(hidden, lin.weight, lin.bias, targets, temps, head.softcap, head.scale,
                                           chunk)
    if not torch.is_grad_enabled():
        return torch.cat([_chunk_logprobs(head, hidden[s:s + chunk], targets[s:s + chunk], temps[s:s + chunk])
                          for s in range(0, N, chunk)]) if N else hidden.new_zeros(0, dtype=torch.float32)
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_chunk_logprobs, head, hidden[s:s + chunk], targets[s:s + chunk], temps[s:s + chunk],
                        use_reentrant=False) for s in range(0, N, chunk)]
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def _frozen_linear(module: torch.nn.Module) -> bool:
    """A plain `nn.Linear` (not a peft wrapper or subclass) none of whose parameters train."""
    return type(module) is torch.nn.Linear and not any(p.requires_grad for p in module.parameters())


def _chunk_logprobs(head: Head, hidden: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits_of(head, hidden).float() / temps[:, None], -1)  # (c, V): one chunk's
    return logp.gather(-1, targets[:, None])[:, 0]


class _FrozenLinearLogprobs(torch.autograd.Function):
    """Chunked selected log-probs through a frozen linear head, with d out_t / d hidden_t computed in the forward
    pass (one (N, H) tensor, only when `hidden` needs a gradient); the backward pass scales it per token."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temps: torch.Tensor, softcap: float | None, scale: float,
                chunk: int) -> torch.Tensor:
        N = hidden.shape[0]
        out = torch.empty(N, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        rows = torch.arange(min(chunk, N), device=hidden.device)
        for s in range(0, N, chunk):
            h, y, t = hidden[s:s + chunk], targets[s:s + chunk, None], temps[s:s + chunk, None]
            logits = onednn.linear(h, weight, bias)
            if scale != 1.0:
                logits = logits * scale
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            logp = torch.log_softmax(logits.float() / t, -1)  # (c, V) fp32: one fused pass, as the full path's
            out[s:s + chunk] = logp.gather(-1, y)[:, 0]
            if grad is None:
                continue
            # d out / d (logits / T) = onehot(y) - softmax; then through / T, the soft cap (1 - (l / cap)^2), the scale
            dz = logp.exp_().mul_(-1.0 / t)  # -softmax / T, in place of logp
            dz[rows[:len(h)], y[:, 0]] += 1.0 / t[:, 0]
            if softcap is not None:
                dz.mul_(1.0 - (logits.float() / softcap) ** 2)
            if scale != 1.0:
                dz.mul_(scale)
            grad[s:s + chunk] = onednn.linear(dz.to(weight.dtype), weight.t())
        ctx.save_for_backward(grad)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return ((grad.float() * grad_out[:, None]).to(grad.dtype), None, None, None, None, None, None, None)
