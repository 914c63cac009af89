"""Token layout for the hf model: the chat template, the context rule, the static prompt prefix, and the batched
prefix | pad gap | suffix layout that generation and the trainer's logprob pass share."""

from __future__ import annotations

import json
from pathlib import Path
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
        # decoding stops at the tokenizer's EOS and at the model's own end-of-turn tokens (its generation config:
        # Gemma's <end_of_turn>, Phi-3's <|end|>, Llama 3's <|eot_id|> are not always the tokenizer's EOS)
        self.eos_ids = {tokenizer.eos_token_id, *generation_eos_ids(tokenizer), *(
            [tokenizer.convert_tokens_to_ids("<|endoftext|>")] if "<|endoftext|>" in tokenizer.get_vocab() else [])}
        self.fold_system = rejects_system_role(tokenizer)
        """The chat template refuses a system message (Gemma, Mistral v0.1/v0.2): it goes into the first user turn."""
        self._marker = tokenizer.encode("\n[...]\n", add_special_tokens=False)
        self._prefix_ids: dict[tuple[str, ...], tuple[int, ...]] = {}

    def encode(self, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[list[int], bool]:
        """Chat-template token ids of a prompt, middle-truncated to fit the context with room to answer."""
        budget = max(self.max_context - max_new_tokens, 64)
        return truncate_middle(self.template(messages, True), budget, self._marker)

    def template(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        if self.fold_system:
            messages = fold_system(messages)
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


def generation_eos_ids(tokenizer: Any) -> set[int]:
    """The `eos_token_id`s of the generation_config.json beside the tokenizer (a model directory), if any: the
    tokens `generate` stops at, which include the chat turn's end where that is not the tokenizer's EOS."""
    where = getattr(tokenizer, "name_or_path", None)
    if not isinstance(where, str) or not where:
        return set()
    try:
        ids = json.loads((Path(where) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # no file (a hub id, a bare tokenizer), bad JSON, not a mapping
        return set()
    return {i for i in (ids if isinstance(ids, list) else [ids]) if isinstance(i, int)}


def rejects_system_role(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template raises on a system message but renders it folded into the user turn
    (Gemma's "System role not supported", Mistral v0.1/v0.2's "roles must alternate")."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:
        tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        return False
    except Exception:  # the template's raise_exception (a jinja2 TemplateError), or any other refusal
        pass
    try:
        tokenizer.apply_chat_template(fold_system(probe), add_generation_prompt=True, tokenize=False)
        return True
    except Exception:
        return False  # refused either way: the error shows at the first call, as the template words it


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The system message (if first) prepended to the first user turn, for templates without a system role."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0]["content"], messages[1:]
    if rest and rest[0]["role"] == "user":
        return [{**rest[0], "content": f"{system}\n\n{rest[0]['content']}"}, *rest[1:]]
    return [{"role": "user", "content": system}, *rest]


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills padding positions (masked out, so any id works; the tokenizer's pad, else its EOS)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def left_pad(prefix_len: int, suffixes: list[list[int]], pad_id: int, device: torch.device | str
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids, attention mask and position ids of `suffixes` after a shared prefix of `prefix_len` tokens
    (whose KV is cached): prefix | pad gap | suffix, each suffix left-padded to the longest. Built as lists and
    copied to `device` once (one host-to-device copy per tensor, not one per row)."""
    P, S = prefix_len, max(len(x) for x in suffixes)
    ids = torch.tensor([[pad_id] * (S - len(x)) + list(x) for x in suffixes], dtype=torch.long,
                       device=device)  # (B, S): suffixes, left-padded
    mask = torch.tensor([[1] * P + [0] * (S - len(x)) + [1] * len(x) for x in suffixes], dtype=torch.long,
                        device=device)  # (B, P+S): prefix | pad gap | suffix
    pos = (P + mask[:, P:].cumsum(-1) - 1).clamp(min=0)  # (B, S)
    return ids, mask, pos


def prefill(model: Any, prefix: list[int] | tuple[int, ...], cache: Any = None) -> Any:
    """KV cache of `prefix` at batch 1 (a DynamicCache; `batch_repeat_interleave` broadcasts it), or `cache` (batch
    1) extended by `prefix`, its positions continuing from the cache's length."""
    from transformers import DynamicCache

    cache = DynamicCache() if cache is None else cache
    model(input_ids=torch.tensor([prefix], device=model.device), past_key_values=cache, use_cache=True,
          logits_to_keep=1)
    return cache


def stack_prefixes(caches: list[Any | None], lengths: list[int], device: torch.device | str
                   ) -> tuple[Any, torch.Tensor]:
    """One batch KV cache from batch-1 prefix caches of different lengths, one per row (None: the row has no cached
    prefix): each row's prefix KV left-padded with zeros to the longest, and the (rows, longest) attention mask that
    hides the padding. The keys keep the positions they were computed at (a row's next token takes position
    `lengths[row]`: positions come from the mask's running count), so rows with different static prefixes (the
    nodes of a graph: each its own system prompt) decode in one batch."""
    from transformers import DynamicCache

    longest = max(lengths)
    template = next(c for c in caches if c is not None)
    distinct = list({id(c): c for c in caches}.values())
    slot = {id(c): k for k, c in enumerate(distinct)}
    rows = torch.tensor([slot[id(c)] for c in caches], dtype=torch.long, device=device)
    out = DynamicCache()
    for index, layer in enumerate(template.layers):
        keys, values = [], []
        for c in distinct:
            k, v = (c.layers[index].keys, c.layers[index].values) if c is not None else (
                layer.keys[:, :, :0], layer.values[:, :, :0])
            keys.append(torch.nn.functional.pad(k, (0, 0, longest - k.shape[2], 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, longest - v.shape[2], 0)))
        out.update(torch.cat(keys).index_select(0, rows), torch.cat(values).index_select(0, rows), index)
    mask = torch.tensor([[0] * (longest - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
    return out, mask


def picked_rows(cache: Any, rows: list[int]) -> Any:
    """A new DynamicCache of batch rows `rows` (repeats allowed) of `cache` (None stays None), by `index_select`.
    Transformers' `batch_select_indices` indexes with `keys[rows]`, whose backward on a CPU accumulates repeated rows
    with atomic adds in no fixed order, so a gradient through a KV that several rows share changed in its last bits
    from run to run (and Adam turned that into weight differences of ~lr/10); `index_select`'s backward sums in index
    order."""
    if cache is None:
        return None
    from transformers import DynamicCache

    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    if not layers:
        return DynamicCache()
    pick = torch.tensor(rows, dtype=torch.long, device=layers[0].keys.device)
    return DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, pick), layer.values.index_select(0, pick))
                                        for layer in layers])
