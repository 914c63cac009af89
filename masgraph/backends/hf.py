"""In-process transformers backend: dynamic batching across episodes, named LoRA adapters on one base,
token ids and per-token logprobs for every completion."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from masgraph.backends.base import BackendError, Completion, Request, truncate_middle
from masgraph.model import resolve_model


def pick_dtype(reps: int = 50, margin: float = 1.3) -> torch.dtype:
    """bf16 if it is clearly (`margin`x) faster than fp32 for a decode-shaped matmul on this CPU, else fp32.

    bf16 won 1.5-2x on the machine DESIGN.md measured; on AMX-advertising VMs capped to AVX512-BF16 fp32
    wins (254 vs 150 GFLOP/s), so the choice is measured rather than assumed. It is measured once per
    machine and torch version and kept in the cache, so every process (a resumed training run too)
    uses the same dtype even when the machine is busy."""
    import json
    import platform

    from masgraph.model import cache_dir

    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
               platform.processor())
    key = f"{cpu}|{torch.__version__}|{torch.get_num_threads()}"
    path = cache_dir() / "dtype-choice.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return getattr(torch, known[key])
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(32, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        x @ w  # warm-up
        best = float("inf")
        for _ in range(5):  # best of 5 trials: robust to a busy machine
            t0 = time.perf_counter()
            for _ in range(reps // 5):
                x @ w
            best = min(best, time.perf_counter() - t0)
        times[dtype] = best
    choice = torch.bfloat16 if times[torch.bfloat16] * margin < times[torch.float32] else torch.float32
    known[key] = str(choice).removeprefix("torch.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time
    return choice


def _lora_shape(cfg: Any) -> dict[str, Any]:
    """The parts of a PEFT config that decide an adapter's weights and output (not its bookkeeping fields)."""
    d = cfg.to_dict()
    keys = ("peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
            "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "exclude_modules")
    shape = {k: d.get(k) for k in keys}
    targets = d.get("target_modules")
    shape["target_modules"] = sorted(targets) if isinstance(targets, (list, set, tuple)) else targets
    return shape


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


@dataclass
class LoraConfigSpec:
    """LoRA shape of one named adapter."""

    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0


class HFBackend:
    """Serves chat completions from a local transformers model.

    Concurrent `complete` calls from all episodes are queued and run as one batched decode: the batcher
    takes what is queued, waits up to `batch_wait_ms` for more (never when the batch is full), and
    decodes them together. The static part of each prompt (system prompt + few-shot turns) is prefilled
    once and its KV cache reused, so a batch only prefills what differs per request.

    `deterministic` (a plain attribute; switch it between runs) makes results bit-exact whatever the
    concurrency and arrival timing: a row's floating point result depends on the batch it decodes in
    (padding and batch size change the kernels' summation order: up to 2.5e-5 on fp32 logits, 0.3 on bf16,
    measured), so each row decodes alone (batch 1) on the shared prefix KV, and samples from its own
    generator seeded by the request (`Request.seed`; seedless rows share the backend's, in key order).

    Example:
        >>> b = HFBackend()                                       # embedded SmolLM2-135M, bf16
        >>> [c] = asyncio.run(b.complete([Request([{"role": "user", "content": "Hi"}])]))
        >>> len(c.completion_ids) == len(c.logprobs)
        True
    """

    returns_tokens = True

    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto", max_batch_size: int = 32,
                 batch_wait_ms: float = 3.0, deterministic: bool = False, max_context: int = 2048,
                 seed: int = 0, threads: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a 0.1 s load needs no bar; our own progress goes to stderr
        # peft calls a transformers API deprecated in 5.x; the warning is not actionable for users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if threads:
            torch.set_num_threads(threads)
        path = resolve_model(model)
        self.model_name = model
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.dtype = pick_dtype() if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
        self.base_model = self.model
        tok = self.tokenizer
        self.eos_ids = {tok.eos_token_id, *(
            [tok.convert_tokens_to_ids("<|endoftext|>")] if "<|endoftext|>" in tok.get_vocab() else [])}
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.max_context = max_context
        self.max_batch_size = max_batch_size
        self.batch_wait_ms = batch_wait_ms
        self.deterministic = deterministic
        self.versions: dict[str | None, int] = {None: 0}
        self._marker = self.tokenizer.encode("\n[...]\n", add_special_tokens=False)
        self._rng = torch.Generator().manual_seed(seed)
        self._queue: list[tuple[Request, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._prefix_ids: dict[tuple[str, ...], tuple[int, ...]] = {}
        self._prefix_kv: dict[tuple, Any] = {}
        # one dedicated thread runs every decode: torch's OpenMP team is per calling thread, and teams of
        # several pool threads spin against each other on a small CPU (2.2x slower at batch 1, measured)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="masgraph-hf")
        self.stats = {"batches": 0, "rows": 0, "generated_tokens": 0, "generate_s": 0.0,
                      "prefix_hits": 0, "prefix_misses": 0}

    # ---- adapters -------------------------------------------------------------------------------
    def add_adapter(self, name: str, lora: LoraConfigSpec | None = None) -> None:
        """Attach a fresh (zero-effect) LoRA adapter named `name` to the shared base model."""
        from peft import LoraConfig

        lora = lora or LoraConfigSpec()
        self._attach(name, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                                      lora_dropout=lora.dropout, task_type="CAUSAL_LM"))
        self.versions[name] = 0

    def _attach(self, name: str, cfg: Any) -> None:
        from peft import PeftModel, get_peft_model

        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, cfg)
        else:
            self.model = get_peft_model(self.base_model, cfg, adapter_name=name)
        self.model.eval()

    def load_adapter(self, name: str, path: str) -> None:
        """Load a saved PEFT adapter directory under `name`, in the LoRA shape it was saved with (its
        adapter_config.json). An existing adapter of that shape gets the weights in place (its parameter objects,
        which an optimizer may hold, stay); one of another shape is replaced by new parameters. Every LoRA
        weight must load, else BackendError (and no adapter `name` is left loaded)."""
        from peft import PeftConfig
        from safetensors.torch import load_file

        try:
            cfg = PeftConfig.from_pretrained(path)
            state = load_file(os.path.join(path, "adapter_model.safetensors"))
        except Exception as exc:  # missing file, bad JSON, truncated safetensors: several kinds
            raise BackendError(f"cannot read adapter checkpoint {path} ({type(exc).__name__}: {exc}); fix: point at "
                               "a directory saved by save_pretrained (adapter_config.json + "
                               "adapter_model.safetensors)") from None
        existing = self.model.peft_config.get(name) if name in self.versions else None
        if existing is not None and _lora_shape(existing) != _lora_shape(cfg):
            self.model.delete_adapter(name)
            existing = None
        if existing is None:
            self._attach(name, cfg)
        try:
            self._load_weights(name, path, state)
        except BackendError:  # no half-loaded adapter stays: requests naming it fail as "not loaded"
            self.model.delete_adapter(name)
            self.versions.pop(name, None)
            self._prefix_kv = {k: kv for k, kv in self._prefix_kv.items() if k[0] != name}  # its versions restart
            raise
        self.versions[name] = self.versions[name] + 1 if name in self.versions else 0

    def _load_weights(self, name: str, path: str, state: dict[str, torch.Tensor]) -> None:
        """Set adapter `name`'s weights from a saved state dict, strictly: no LoRA weight missing, no key unused."""
        from peft import set_peft_model_state_dict

        try:
            result = set_peft_model_state_dict(self.model, state, adapter_name=name)
        except RuntimeError as exc:  # size mismatch
            raise BackendError(f"adapter checkpoint {path} does not fit adapter {name!r}: {exc}") from None
        missing = [k for k in result.missing_keys if "lora_" in k and name in k.split(".")]
        if missing or result.unexpected_keys:
            raise BackendError(
                f"adapter checkpoint {path} does not match its own adapter_config.json: {len(missing)} LoRA weights "
                f"missing (e.g. {missing[:2]}), {len(result.unexpected_keys)} unexpected "
                f"(e.g. {result.unexpected_keys[:2]}); fix: re-save the adapter, or resume from an earlier checkpoint")

    # ---- serving --------------------------------------------------------------------------------
    async def complete(self, requests: list[Request]) -> list[Completion]:
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done():
            self._wake = asyncio.Event()
            self._worker = loop.create_task(self._batch_loop())
        futures = []
        for req in requests:
            fut = loop.create_future()
            self._queue.append((req, fut))
            futures.append(fut)
        self._wake.set()
        return list(await asyncio.gather(*futures))

    async def _batch_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            await self._gather_more()
            batch, self._queue = self._queue[:self.max_batch_size], self._queue[self.max_batch_size:]
            if not self._queue:
                self._wake.clear()
            batch = [(r, f) for r, f in batch if not f.cancelled()]
            if not batch:
                continue
            if self.deterministic:
                batch.sort(key=lambda rf: rf[0].key)
            try:
                results = await asyncio.get_running_loop().run_in_executor(
                    self._executor, self.generate, [r for r, _ in batch])
            except Exception as exc:  # the whole batch fails; each step records it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(BackendError(f"hf generate failed: {type(exc).__name__}: {exc}"))
                continue
            for (_, fut), res in zip(batch, results):
                if not fut.done():
                    fut.set_result(res)

    async def _gather_more(self) -> None:
        """Wait briefly for more requests: until the batch is full or `batch_wait_ms` passes with no arrival."""
        if self.batch_wait_ms <= 0:
            await asyncio.sleep(0)
            return
        while len(self._queue) < self.max_batch_size:
            n = len(self._queue)
            await asyncio.sleep(self.batch_wait_ms / 1000)
            if len(self._queue) == n:
                return

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except (asyncio.CancelledError, Exception):
                pass
            self._worker = None

    def encode(self, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[list[int], bool]:
        """Chat-template token ids of a prompt, middle-truncated to fit the context with room to answer."""
        budget = max(self.max_context - max_new_tokens, 64)
        return truncate_middle(self._template(messages, True), budget, self._marker)

    def _template(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def _static_prefix(self, messages: list[dict[str, str]], ids: list[int]) -> tuple[int, ...]:
        """The prompt's static part (every turn but the last: system prompt and few-shot examples) when it
        is a token prefix of the full prompt; its KV cache is computed once and reused across calls."""
        if len(messages) < 2:
            return ()
        key = tuple(m["content"] for m in messages[:-1])
        prefix = self._prefix_ids.get(key)
        if prefix is None:
            prefix = self._prefix_ids[key] = tuple(self._template(messages[:-1], False))
        n = len(prefix)
        return prefix if 16 <= n < len(ids) and tuple(ids[:n]) == prefix else ()

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Decode a batch of requests (blocking). Rows that share adapter and static prompt prefix decode
        together on that prefix's cached KV (one at a time in deterministic mode); each group is left-padded
        and KV-cached."""
        t0 = time.perf_counter()
        encoded = [self.encode(r.messages, r.sampling.max_tokens) for r in requests]
        prompts = [ids for ids, _ in encoded]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            prefix = () if encoded[i][1] else self._static_prefix(r.messages, prompts[i])
            groups.setdefault((r.adapter, prefix), []).append(i)
        decoded: dict[int, tuple[list[int], list[float], str]] = {}
        for (adapter, prefix), rows in groups.items():
            with self._adapter_context(adapter):
                for chunk in ([[i] for i in rows] if self.deterministic else [rows]):  # batch 1: batch-invariant
                    outs = self._decode(prefix, [prompts[i][len(prefix):] for i in chunk],
                                        [requests[i] for i in chunk], adapter)
                    decoded.update(zip(chunk, outs))
        results = []
        for i, r in enumerate(requests):
            ids, lps, finish = decoded[i]
            text_ids = ids[:-1] if ids and ids[-1] in self.eos_ids else ids
            results.append(Completion(
                text=self.tokenizer.decode(text_ids, skip_special_tokens=True), prompt_ids=prompts[i],
                completion_ids=ids, logprobs=lps, finish_reason=finish, prompt_truncated=encoded[i][1],
                policy_version=self.versions.get(r.adapter, 0)))
        self.stats["batches"] += 1
        self.stats["rows"] += len(requests)
        self.stats["generated_tokens"] += sum(len(c.completion_ids) for c in results)
        self.stats["generate_s"] += time.perf_counter() - t0
        return results

    def _adapter_context(self, adapter: str | None) -> contextlib.AbstractContextManager:
        if adapter is not None and adapter not in self.versions:
            raise BackendError(f"adapter {adapter!r} is not loaded on {self.model_name}; loaded: "
                               f"{sorted(k for k in self.versions if k)}")
        if self.model is self.base_model:
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        self.model.set_adapter(adapter)
        return contextlib.nullcontext()

    def _prefix_cache(self, prefix: tuple[int, ...], adapter: str | None) -> Any:
        """KV cache of a static prefix at batch 1 (LRU of 16; keyed by adapter version, so an update
        of the adapter's weights invalidates it)."""
        from transformers import DynamicCache

        key = (adapter, self.versions.get(adapter, 0), prefix)
        cache = self._prefix_kv.pop(key, None)
        if cache is None:
            cache = DynamicCache()
            self.model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            self.stats["prefix_misses"] += 1
        else:
            self.stats["prefix_hits"] += 1
        self._prefix_kv[key] = cache  # most recently used last
        while len(self._prefix_kv) > 16:
            self._prefix_kv.pop(next(iter(self._prefix_kv)))
        return cache

    def _decode(self, prefix: tuple[int, ...], suffixes: list[list[int]], requests: list[Request],
                adapter: str | None) -> list[tuple[list[int], list[float], str]]:
        from transformers import DynamicCache

        B, P, S = len(suffixes), len(prefix), max(len(x) for x in suffixes)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)  # (B, S): suffixes, left-padded
        mask = torch.zeros((B, P + S), dtype=torch.long)  # (B, P+S): prefix | pad gap | suffix
        mask[:, :P] = 1
        for i, x in enumerate(suffixes):
            ids[i, S - len(x):] = torch.tensor(x)
            mask[i, P + S - len(x):] = 1
        pos = (P + mask[:, P:].cumsum(-1) - 1).clamp(min=0)  # (B, S)
        if P:
            cache = copy.deepcopy(self._prefix_cache(prefix, adapter))
            if B > 1:
                cache.batch_repeat_interleave(B)
        else:
            cache = DynamicCache()
        gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None else self._rng for r in requests]
        limits = [r.sampling.max_tokens for r in requests]
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        done, finish = [False] * B, ["length"] * B
        for _ in range(max(limits)):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1, :]  # (B, V)
            picked = self._sample(logits.float(), requests, gens, done)
            for i, pick in enumerate(picked):
                if pick is None:
                    continue
                out_ids[i].append(pick[0])
                out_lp[i].append(pick[1])
                if pick[0] in self.eos_ids:
                    done[i], finish[i] = True, "stop"
                elif len(out_ids[i]) >= limits[i]:
                    done[i] = True
            if all(done):
                break
            ids = torch.tensor([[p[0] if p else self.pad_id] for p in picked])  # (B, 1)
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
        return list(zip(out_ids, out_lp, finish))

    def _sample(self, logits: torch.Tensor, requests: list[Request], gens: list[torch.Generator],
                done: list[bool]) -> list[tuple[int, float] | None]:
        """Pick one token per live row; logprob under the temperature-scaled distribution (raw if greedy)."""
        temps = torch.tensor([r.sampling.temperature or 1.0 for r in requests])[:, None]
        logp = torch.log_softmax(logits / temps, -1)  # (B, V)
        toks = torch.argmax(logits, -1).tolist()
        for i, r in enumerate(requests):
            if done[i] or r.sampling.temperature == 0:
                continue
            probs = logp[i].exp()
            if r.sampling.top_p < 1.0:
                sp, si = torch.sort(probs, descending=True)
                keep = (sp.cumsum(0) - sp) < r.sampling.top_p
                probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
            toks[i] = int(torch.multinomial(probs, 1, generator=gens[i]))
        picked = logp.gather(1, torch.tensor(toks)[:, None])[:, 0].tolist()
        return [None if done[i] else (toks[i], picked[i]) for i in range(len(requests))]
