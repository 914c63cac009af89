"""The in-process hf learner: LoRA adapters on an `HFModel` that hf backends serve from (the same object)."""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from masgraph.backends.base import LoraConfigSpec, TokenRow
from masgraph.backends.hf import buckets
from masgraph.backends.hf.cascade import gaps_fit
from masgraph.backends.hf.layout import left_pad, pad_token_id, picked_rows, prefill
from masgraph.backends.hf.logprobs import check_head, model_head, selected_logprobs
from masgraph.backends.hf.model import HFModel
from masgraph.backends.hf.prefixes import PrefixStore
from masgraph.errors import MasgraphError
from masgraph.learn.packing import PackPlan, plan_rows
from masgraph.threads import fit_threads


class HFLearner:
    """Trains named LoRA adapters of one transformers model; implements `masgraph.learner.Learner`.

    Serve its adapters with `HFBackend(learner.weights)` and `WeightSync(learner, [backend])`: the backend decodes
    with the very tensors the optimizer steps, so publishing a version copies nothing.

    Example:
        >>> learner = HFLearner("smollm2-135m", dtype="float32")
        >>> learner.add_adapter("planner", LoraConfigSpec())
        >>> backend = HFBackend(learner.weights)
        >>> WeightSync(learner, [backend])()      # backend now serves planner v0
    """

    def __init__(self, model: str | HFModel = "smollm2-135m", dtype: str = "auto", threads: int | None = None,
                 device: str = "auto"):
        self.weights = model if isinstance(model, HFModel) else HFModel(model, dtype, threads, device)
        self._pad_id = pad_token_id(self.weights.tokenizer)
        self._versions: dict[str, int] = {a: 0 for a in self.weights.adapters()}
        self.pack = True
        """Merge turns and share prompts in a pass (`masgraph.learn.packing`); off only to compare with the layout
        before packing (the prefix common to all rows alone)."""
        self._pack: Counter[str] = Counter()
        self._prefixes: PrefixStore | None = None
        self.pass_overhead: int | None = buckets.pass_cost(self.weights.model)
        """The tails of a logprob pass run as passes over rows of similar length, grouped by this per-pass cost in
        positions (`buckets.plan`; None: one left-padded pass). A sharded learner keeps one pass: every rank must run
        as many passes as the others."""
        check_head(self.weights.model, model_head(self.weights.model))  # the log-probs' head is the model's own

    @property
    def dtype(self) -> str:
        return str(self.weights.dtype).removeprefix("torch.")

    @property
    def device(self) -> torch.device:
        """Where the weights, the adapters, their gradients and optimizer states live."""
        return self.weights.device

    @property
    def sharded(self) -> bool:
        """Whether the base's decoder layers are split across the learner ranks (`shard`): then every rank runs each
        logprob pass (`masgraph.learn.sharding`)."""
        return self.weights.sharded

    def shard(self, dp: Any) -> int:
        """Split the base's decoder layers, adapters included, across the learner ranks of `dp` (a
        `masgraph.learn.data_parallel.DataParallel`) with FSDP2: every rank, once its adapters are attached and
        before a trainer is built on them. The adapters start as rank 0's. Returns the number of layers sharded."""
        dp.broadcast_parameters([p for a in sorted(self._versions) for p in self.parameters(a)])
        return self.weights.shard(dp)

    def gather(self) -> None:
        """After an update of a sharded learner, on every rank: the adapters' whole tensors for `save` and
        `source` (a collective); nothing when the learner is whole."""
        self.weights.gather()

    def gradient_checkpointing(self, on: bool) -> None:
        """Trade compute for memory in the logprob pass (see `HFModel.set_gradient_checkpointing`)."""
        self.weights.set_gradient_checkpointing(on)

    def adapters(self) -> list[str]:
        return list(self._versions)

    def add_adapter(self, name: str, lora: LoraConfigSpec) -> None:
        """Attach a fresh (zero-effect) LoRA adapter at version 0 (its init draws from torch's global RNG)."""
        self.weights.add_adapter(name, lora)
        self._versions[name] = 0

    def lora_targets(self, name: str) -> list[str] | str:
        """The modules adapter `name` targets on this model, as its saved adapter_config.json records them."""
        self._check(name)
        return self.weights.lora_targets(name)

    def parameters(self, adapter: str) -> list[torch.Tensor]:
        self._check(adapter)
        return [p for n, p in self.weights.model.named_parameters() if "lora_" in n and f".{adapter}." in n]

    def sequence_logprobs(self, rows: Sequence[TokenRow], adapter: str | None) -> list[torch.Tensor]:
        """Per-token logprobs of each row's completion under `adapter` (None: the reference, adapters off)."""
        if adapter is not None:
            self._check(adapter)
        fit_threads()  # this pass's forward and backward: one thread while other processes hold the cores
        # one forward per pass when checkpointing (a cache cannot be recomputed) or sharded (every rank must all-gather
        # the layers as often as the others)
        share = not (self.weights.gradient_checkpointing or self.sharded)
        store = self._prefixes if share and self.pack else None
        if store is not None:  # passes come adapter by adapter: the others' kept prefixes (and graphs) are done
            self._release(store, keep=(adapter,))
        known = store.known(adapter, rows) if store else 0
        plan = plan_rows(rows, share=share, pack=self.pack, known=known)
        if share and not gaps_fit(self.weights.model.config, plan.positions(rows)):
            plan = plan_rows(rows, share=False, pack=self.pack)  # whole sequences, left-padded: no gap in a window
        reused = store.reused if store else 0
        with self.weights.use(adapter):
            out = sequence_logprobs(self.weights.model, rows, self._pad_id, plan=plan,
                                    pass_overhead=None if self.sharded else self.pass_overhead, prefixes=store,
                                    adapter=adapter)
        if torch.is_grad_enabled():  # the update's own passes (not the reference's): what `pack_stats` reports
            stats = plan.stats(rows)
            stats["tokens_computed"] -= (store.reused - reused) if store else 0
            self._pack.update(stats)
        return out

    @contextmanager
    def shared_prefixes(self) -> Iterator[None]:
        """Within: each adapter's logprob passes read the prompt prefix an earlier pass computed instead of computing
        it again (`hf/prefixes.py`); on a normal exit, the gradient the passes sent into it goes back through its one
        forward. Open it around the passes of one adapter version (a reference pass; one optimizer step's passes),
        and close it before the optimizer steps. Off with `pack` off, gradient checkpointing or sharding.
        Each adapter's prefix is released (its gradient sent back) when a pass of another adapter comes, so one
        adapter's prefix graph is held at a time; an adapter that comes back computes its prefix again."""
        store = PrefixStore()
        self._prefixes = store
        try:
            yield
            self._release(store)
        finally:
            self._prefixes = None

    def _release(self, store: PrefixStore, keep: tuple[str | None, ...] = ()) -> None:
        """Send the kept prefixes' gradients back (but those of `keep`), each with its adapter active (PEFT's
        `set_adapter` turns the others' `requires_grad` off, and autograd drops a gradient for a parameter that does
        not require one), and forget them."""
        for adapter in store.adapters():
            if adapter not in keep:
                with self.weights.use(adapter):
                    store.backward(adapter)

    def pack_stats(self) -> dict[str, int]:
        """Rows, sequences and tokens (received, computed) of the gradient passes since the last call; resets."""
        out, self._pack = dict(self._pack), Counter()
        return out

    def train(self, mode: bool = True) -> None:
        self.weights.model.train(mode)

    def version(self, adapter: str) -> int:
        self._check(adapter)
        return self._versions[adapter]

    def new_version(self, adapter: str) -> int:
        self._versions[adapter] = self.version(adapter) + 1
        return self._versions[adapter]

    def source(self, adapter: str) -> HFAdapterSource:
        self._check(adapter)
        return HFAdapterSource(self.weights, adapter)

    def save(self, path: str, adapters: Sequence[str]) -> None:
        for a in adapters:
            self._check(a)
        self.weights.save(path, list(adapters))

    def load_adapter(self, name: str, path: str, version: int | None = None) -> None:
        """Load a saved PEFT directory (strictly, in its own LoRA shape; see `HFModel.load_adapter`) as `version`
        (default: the next one). A failed load leaves no adapter `name` (a refused one, on a sharded model, leaves
        everything as it was)."""
        try:
            self.weights.load_adapter(name, path)
        except MasgraphError:
            if not self.sharded:  # a sharded model keeps every adapter as it was
                self._versions.pop(name, None)
            raise
        self._versions[name] = version if version is not None else self._versions.get(name, -1) + 1

    def rng_state(self) -> dict[str, Any]:
        """The global torch RNGs (LoRA init, dropout: the CPU one, and every GPU's when the model is on one) and
        Python's `random`. Rollout sampling is seeded per request, so no backend generator is part of it."""
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def set_rng_state(self, state: dict[str, Any]) -> None:
        """Restore `rng_state()`; other keys (a "backend" generator in older checkpoints) are ignored, and so are
        GPU states when resuming on another machine shape (the CPU one decides LoRA init; dropout is off)."""
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        cuda = state.get("cuda")
        if cuda is not None and self.device.type == "cuda" and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)

    def _check(self, adapter: str) -> None:
        if adapter not in self._versions:
            raise MasgraphError(f"adapter {adapter!r} is not on the learner (it has {sorted(self._versions)}); "
                                f"fix: learner.add_adapter({adapter!r}, LoraConfigSpec(...)) first")


class HFAdapterSource:
    """One adapter of an `HFModel`, offered to receivers as a PEFT directory or a state dict."""

    def __init__(self, weights: HFModel, adapter: str):
        self.home, self.adapter = weights, adapter

    def save(self, path: str) -> str:
        self.home.save(path, [self.adapter])
        return os.path.join(path, self.adapter)

    def state_dict(self) -> dict[str, Any]:
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.home.model, state_dict=self.home.full, adapter_name=self.adapter)


def sequence_logprobs(model: Any, rows: Sequence[TokenRow], pad_id: int, share_prefix: bool = True,
                      chunk_tokens: int | None = None, pack: bool = True,
                      plan: PackPlan | None = None, pass_overhead: int | None = None,
                      prefixes: PrefixStore | None = None, adapter: str | None = None) -> list[torch.Tensor]:
    """Per-token logprobs of each row's completion under `model` at the row's own temperature (teacher-forced),
    on the model's device: the backbone's final hidden states at the completion positions go through
    `selected_logprobs`, which never builds a (rows x tokens x vocabulary) tensor (`chunk_tokens` x V at a time).

    Shared tokens are computed once (`masgraph.learn.packing.plan_rows`): the prefix all rows share (system prompt +
    few-shot turns) once at batch 1; with `pack`, a row inside another row's sequence (a node's earlier turn that the
    next prompt extends) is read from that row's pass, and the prompt prefix a cluster of rows shares beyond it (a
    question's samples, its later turns) once per cluster; their KV caches are broadcast to the rows that extend
    them (gradients flow back through them, summed). Layout, as
    in generation (`left_pad`): prefix | left-padded middles | left-padded tails. `share_prefix=False` runs whole
    sequences (gradient checkpointing cannot recompute a cache). A given `plan` (of these rows) replaces both flags.
    `pass_overhead` (positions; `buckets.plan`): the tails run as passes over hosts of similar length instead of one
    pass left-padded to the longest; None: one pass. `prefixes`: the prefix is read from (or kept in) this store,
    under `adapter`'s key (the one active on `model`)."""
    device = model.device
    head = model_head(model)
    if plan is None:
        known = prefixes.known(adapter, rows) if prefixes is not None and share_prefix and pack else 0
        plan = plan_rows(rows, share=share_prefix, pack=pack, known=known)
    seqs = [list(rows[h].prompt_ids) + list(rows[h].completion_ids) for h in plan.hosts]
    P, H = plan.prefix, len(seqs)
    if not P:
        cache = None
    elif prefixes is not None:
        cache = prefixes.cache(model, adapter, seqs[0][:P])
    else:
        cache = prefill(model, seqs[0][:P])
    middle_mask = torch.ones((H, P), dtype=torch.long, device=device)
    source = [0] * H  # each host's row of `cache`: the prefix's one row, or its group's middle
    if plan.groups:  # each distinct middle once; each host's pass picks its group's KV
        firsts = [plan.group.index(g) for g in range(plan.groups)]
        ids, mask, pos = left_pad(P, [seqs[k][P:plan.start[k]] for k in firsts], pad_id, device)
        if cache is not None:
            cache.batch_repeat_interleave(plan.groups)
        cache = _as_cache(cache)
        head.backbone(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        source = list(plan.group)
        middle_mask = mask.index_select(0, torch.tensor(source, dtype=torch.long, device=device))
    tails = [s[b:] for s, b in zip(seqs, plan.start)]
    hidden, end = [], {}  # the tails' passes' final hidden states, flattened; host -> the flat index of its last token
    at = 0
    for hosts in buckets.plan([len(t) for t in tails], pass_overhead):
        # hosts of similar tail length in one pass, each with its own rows of the past KV (summed back in backward)
        if not any(tails[k] for k in hosts):
            continue  # nothing of theirs to run (and no completion token they predict)
        sub = picked_rows(cache, [source[k] for k in hosts])
        ids, tail_mask, _ = left_pad(0, [tails[k] for k in hosts], pad_id, device)
        mask = torch.cat([middle_mask[hosts], tail_mask], dim=1)  # (h, past + S): every position a host may attend
        S = ids.shape[1]
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -S:]
        out = head.backbone(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=sub,
                            use_cache=sub is not None).last_hidden_state  # (h, S, hidden)
        hidden.append(out.reshape(len(hosts) * S, -1))
        end.update({k: at + i * S + S - 1 for i, k in enumerate(hosts)})
        at += len(hosts) * S
    # a row's n completion tokens are predicted by its host's positions p = len(prompt)-1 .. len(prompt)+n-2, which
    # sit in the host's right-aligned tail, len(host's sequence) - 1 - p positions before its last token
    where = [end[k] - (len(seqs[k]) - 1 - p)
             for r, k in zip(rows, plan.host_of)
             for p in range(len(r.prompt_ids) - 1, len(r.prompt_ids) + len(r.completion_ids) - 1)]
    lengths = [len(r.completion_ids) for r in rows]
    targets = torch.tensor([t for r in rows for t in r.completion_ids], dtype=torch.long, device=device)  # (N,)
    temps = torch.tensor([r.temperature for r, n in zip(rows, lengths) for _ in range(n)], device=device)  # (N,)
    where_t = torch.tensor(where, dtype=torch.long, device=device)
    flat = hidden[0] if len(hidden) == 1 else torch.cat(hidden)
    picked = selected_logprobs(flat.index_select(0, where_t), head, targets, temps, chunk_tokens)
    return list(picked.split(lengths))


def _as_cache(cache: Any) -> Any:
    """`cache`, or an empty DynamicCache when there is no prefix to start from."""
    if cache is not None:
        return cache
    from transformers import DynamicCache

    return DynamicCache()
