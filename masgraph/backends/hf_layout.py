"""Token layout for the hf model: the chat template, the context rule, the static prompt prefix, and the batched
prefix | pad gap | suffix layout that generation and the trainer's logprob pass share."""

from __future__ import annotations

from typing import Any

import torch

from masgraph.backends.base import truncate_middle


class TokenLayout:
    """Turns chat messages into the token ids the model sees.

    Example:
        >>> layout = TokenLayout(tokenizer, max_context=2048)
        >>> ids, truncated = layout.encode([{"role": "user", "content": "Hi"}], max_new_tokens=32)
    """

    def __init__(self, tokenizer: Any, max_context: int = 2048):
        self.tokenizer, self.max_context = tokenizer, max_context
        self.pad_id = pad_token_id(tokenizer)
        self.eos_ids = {tokenizer.eos_token_id, *(
            [tokenizer.convert_tokens_to_ids("<|endoftext|>")] if "<|endoftext|>" in tokenizer.get_vocab() else [])}
        self._marker = tokenizer.encode("\n[...]\n", add_special_tokens=False)
        self._prefix_ids: dict[tuple[str, ...], tuple[int, ...]] = {}

    def encode(self, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[list[int], bool]:
        """Chat-template token ids of a prompt, middle-truncated to fit the context with room to answer."""
        budget = max(self.max_context - max_new_tokens, 64)
        return truncate_middle(self.template(messages, True), budget, self._marker)

    def template(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def static_prefix(self, messages: list[dict[str, str]], ids: list[int]) -> tuple[int, ...]:
        """The prompt's static part (every turn but the last: system prompt and few-shot examples) when it
        is a token prefix of the full prompt; its KV cache is computed once and reused across calls."""
        if len(messages) < 2:
            return ()
        key = tuple(m["content"] for m in messages[:-1])
        prefix = self._prefix_ids.get(key)
        if prefix is None:
            prefix = self._prefix_ids[key] = tuple(self.template(messages[:-1], False))
        n = len(prefix)
        return prefix if 16 <= n < len(ids) and tuple(ids[:n]) == prefix else ()


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills padding positions (masked out, so any id works; the tokenizer's pad, else its EOS)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_pad(prefix_len: int, suffixes: list[list[int]], pad_id: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask and position ids of `suffixes` after a shared prefix of `prefix_len` tokens
    (whose KV is cached): prefix | pad gap | suffix, each suffix left-padded to the longest."""
    B, P, S = len(suffixes), prefix_len, max(len(x) for x in suffixes)
    ids = torch.full((B, S), pad_id, dtype=torch.long)  # (B, S): suffixes, left-padded
    mask = torch.zeros((B, P + S), dtype=torch.long)  # (B, P+S): prefix | pad gap | suffix
    mask[:, :P] = 1
    for i, x in enumerate(suffixes):
        ids[i, S - len(x):] = torch.tensor(x)
        mask[i, P + S - len(x):] = 1
    pos = (P + mask[:, P:].cumsum(-1) - 1).clamp(min=0)  # (B, S)
    return ids, mask, pos


def prefill(model: Any, prefix: list[int] | tuple[int, ...]) -> Any:
    """KV cache of `prefix` at batch 1 (a DynamicCache; `batch_repeat_interleave` broadcasts it)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache
