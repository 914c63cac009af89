"""In-process transformers backend: dynamic batching across episodes, named LoRA adapters on one base,
token ids and per-token logprobs for every completion."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import torch

from masgraph.backends.base import BackendError, Completion, Request, truncate_middle
from masgraph.model import resolve_model

BASE = "__base__"  # peft's name for "no adapter" in mixed-adapter batches


def pick_dtype(reps: int = 20) -> torch.dtype:
    """The faster of bf16 and fp32 for a decode-shaped matmul on this CPU (measured, ~0.1 s).

    bf16 won 1.5-2x on the machine DESIGN.md measured; on AMX-advertising VMs capped to AVX512-BF16
    fp32 wins (254 vs 150 GFLOP/s), so the choice is measured rather than assumed."""
    best, best_t = torch.float32, float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(32, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        x @ w  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            x @ w
        if (t := time.perf_counter() - t0) < best_t:
            best, best_t = dtype, t
    return best


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
    decodes them together. In `deterministic` mode a batch is formed by count (it waits for
    `max_batch_size` requests, or `batch_wait_ms` of quiet), rows are ordered by request key, and every
    row samples from its own generator seeded by the request — so results do not depend on arrival order.

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

        if threads:
            torch.set_num_threads(threads)
        path = resolve_model(model)
        self.model_name = model
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.dtype = pick_dtype() if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
        self.base_model = self.model
        self.eos_ids = {self.tokenizer.eos_token_id, *(
            [self.tokenizer.convert_tokens_to_ids("<|endoftext|>")] if "<|endoftext|>" in self.tokenizer.get_vocab() else [])}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
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
        self.stats = {"batches": 0, "rows": 0, "generated_tokens": 0, "generate_s": 0.0}

    # ---- adapters -------------------------------------------------------------------------------
    def add_adapter(self, name: str, lora: LoraConfigSpec | None = None) -> None:
        """Attach a fresh (zero-effect) LoRA adapter named `name` to the shared base model."""
        from peft import LoraConfig, PeftModel, get_peft_model

        lora = lora or LoraConfigSpec()
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                         lora_dropout=lora.dropout, task_type="CAUSAL_LM")
        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, cfg)
        else:
            self.model = get_peft_model(self.base_model, cfg, adapter_name=name)
        self.model.eval()
        self.versions[name] = 0

    def load_adapter(self, name: str, path: str) -> None:
        """Load a saved PEFT adapter directory under `name`."""
        from peft import PeftModel

        if isinstance(self.model, PeftModel):
            self.model.load_adapter(path, adapter_name=name)
        else:
            self.model = PeftModel.from_pretrained(self.base_model, path, adapter_name=name)
        self.model.eval()
        self.versions[name] = 0

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
                results = await asyncio.to_thread(self.generate, [r for r, _ in batch])
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
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        budget = max(self.max_context - max_new_tokens, 64)
        return truncate_middle(list(ids), budget, self._marker)

    def _route_adapters(self, adapters: list[str | None]) -> tuple[contextlib.AbstractContextManager, dict]:
        """A context and forward kwargs that apply each row's adapter: base, one adapter, or a mixed batch."""
        for a in adapters:
            if a is not None and a not in self.versions:
                raise BackendError(f"adapter {a!r} is not loaded on {self.model_name}; loaded: "
                                   f"{sorted(k for k in self.versions if k)}")
        if self.model is self.base_model:
            return contextlib.nullcontext(), {}
        names = set(adapters)
        if names == {None}:
            return self.model.disable_adapter(), {}
        if len(names) == 1:  # one adapter for the whole batch: cheaper than peft's mixed-batch path
            self.model.set_adapter(adapters[0])
            return contextlib.nullcontext(), {}
        return contextlib.nullcontext(), {"adapter_names": [a or BASE for a in adapters]}

    @torch.inference_mode()
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Decode a batch of requests together (left-padded, KV-cached); blocking."""
        t0 = time.perf_counter()
        encoded = [self.encode(r.messages, r.sampling.max_tokens) for r in requests]
        prompts = [ids for ids, _ in encoded]
        adapter_ctx, extra = self._route_adapters([r.adapter for r in requests])
        with adapter_ctx:
            out_ids, out_lp, finish = self._decode(prompts, requests, extra)
        results = []
        for i, r in enumerate(requests):
            ids = out_ids[i]
            text_ids = ids[:-1] if ids and ids[-1] in self.eos_ids else ids
            results.append(Completion(
                text=self.tokenizer.decode(text_ids, skip_special_tokens=True), prompt_ids=prompts[i],
                completion_ids=ids, logprobs=out_lp[i], finish_reason=finish[i], prompt_truncated=encoded[i][1],
                policy_version=self.versions.get(r.adapter, 0)))
        self.stats["batches"] += 1
        self.stats["rows"] += len(requests)
        self.stats["generated_tokens"] += sum(len(x) for x in out_ids)
        self.stats["generate_s"] += time.perf_counter() - t0
        return results

    def _decode(self, prompts: list[list[int]], requests: list[Request], extra: dict
                ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        from transformers import DynamicCache

        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)  # (B, L), left-padded
        attn = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            attn[i, L - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(r.seed) if r.seed is not None else self._rng for r in requests]
        limits = [r.sampling.max_tokens for r in requests]
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        done, finish = [False] * B, ["length"] * B
        cache = DynamicCache()
        for _ in range(max(limits)):
            logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=cache,
                                use_cache=True, logits_to_keep=1, **extra).logits[:, -1, :]  # (B, V)
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
            attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
        return out_ids, out_lp, finish

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
