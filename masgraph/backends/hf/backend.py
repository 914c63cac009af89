"""In-process transformers backend: dynamic batching across episodes, named LoRA adapters on one base,
token ids and per-token logprobs for every completion."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any, Literal

import torch

from masgraph.backends.base import BackendError, Completion, LoraConfigSpec, Request
from masgraph.backends.hf.batcher import Batcher
from masgraph.backends.hf.buckets import pass_cost
from masgraph.backends.hf.captured import CapturedDecoder
from masgraph.backends.hf.cascade import Cascade, gaps_fit
from masgraph.backends.hf.decode import decode, prefill_shared
from masgraph.backends.hf.dtype import pick_dtype
from masgraph.backends.hf.layout import TokenLayout, prefill, stack_prefixes
from masgraph.backends.hf.model import HFModel
from masgraph.backends.hf.streamed import TokenText
from masgraph.errors import MasgraphError
from masgraph.learn.packing import share_middles
from masgraph.streaming import sink_for
from masgraph.threads import fit_threads, full_threads, release_team, released_team

if TYPE_CHECKING:
    from masgraph.backends.base import AdapterSource

__all__ = ["HFBackend", "HFModel", "LoraConfigSpec", "pick_dtype"]


def sortable(key: tuple) -> tuple:
    """A request's ordering key made comparable with any other's: numbers before text, element by element (the
    scheduler's (episode, node, turn, k) and a judge's ("judge", digest) meet in one deterministic batch)."""
    return tuple((0, x, "") if isinstance(x, int | float) else (1, 0, str(x)) for x in key)


def cascade_pays(weights: HFModel) -> bool:
    """Whether rows decode through the cascade on these weights: wherever their attention allows it (installed at
    load), on a CPU and on a GPU alike: on an H200 a 64-row decode step of the 0.5B shape took half the time of
    reading a prefix copy per row (58.6 vs 123.4 ms, bf16), though the cascade then nearly doubled its aten ops
    (3,705 vs 1,876; fewer since: benchmarks/results/decode_ops.md, 2026-12-04)."""
    return weights.attention


class HFBackend:
    """Serves chat completions from a local transformers model.

    Concurrent `complete` calls from all episodes are queued and run as one batched decode (`Batcher`). The
    static part of each prompt (system prompt + few-shot turns) is prefilled once and its KV cache reused, so a
    batch only prefills what differs per request.

    `model` is a model name or an `HFModel` to serve from: an in-process learner trains that same object and
    publishes each new adapter version (`publish`), so rollouts use the new weights with no copy. Several
    backends may serve one `HFModel` (e.g. a deterministic one for evaluation beside the training one).

    `deterministic` (set it when constructing, or between runs) makes results bit-exact whatever the
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

    def __init__(self, model: str | HFModel = "smollm2-135m", dtype: str = "auto", max_batch_size: int = 32,
                 batch_wait_ms: float = 3.0, deterministic: bool = False, max_context: int = 2048,
                 seed: int = 0, threads: int | None = None, device: str = "auto"):
        self.weights = model if isinstance(model, HFModel) else HFModel(model, dtype, threads, device)
        if self.weights.sharded:
            raise MasgraphError("a learner's weights sharded across ranks cannot decode in one process; fix: give the "
                                "rollouts their own model (a replica, Ray workers or a vLLM server)")
        limit = self.weights.max_positions  # a model built for a shorter context keeps to it
        self.layout = TokenLayout(self.weights.tokenizer, min(max_context, limit) if limit else max_context)
        self.deterministic = deterministic
        self.share_prompts = True
        """Prefill a prompt part several rows of a batch share once (off only to compare with the layout before)."""
        self.one_loop_per: Literal["batch", "adapter", "prefix"] = "adapter"
        """Which rows of a batch decode in one loop: those of one adapter, whatever their static prefixes (stacked),
        the default; all of them ("batch": the adapters mixed in each forward pass through PEFT's `adapter_names`);
        or those of one adapter and static prefix ("prefix": the layout before). On this project's 2-core CPU
        "batch" measured no faster than "adapter" on the AgentFlow graph (results/rollout_throughput.md,
        2026-12-02): it is kept for devices where a decode step costs the same at any batch size (not measured)."""
        self.cascade = cascade_pays(self.weights)
        """Rows on a cached static prefix attend its KV where it is, once per distinct prefix (cascade attention,
        masgraph/backends/hf/cascade.py), instead of a copy per row (`cascade_pays`; off only to compare
        with the layout before)."""
        self.pass_overhead = pass_cost(self.weights.model)
        """A batch's prompt parts of different lengths run as passes over rows of similar length, `plan` weighing
        this many positions per pass (masgraph/backends/hf/buckets.py); None: one pass, left-padded to the longest
        (another device than a CPU, a windowed model, or to compare with the layout before)."""
        self.drop_finished = True
        """A row that finished (EOS or its max_tokens) leaves its decode batch at the end of that step; off only to
        compare with the layout before (the row rode along until the batch's longest row ended: on a CPU a step
        costs in proportion to its rows)."""
        self.captured: CapturedDecoder | None = None
        """Where set (`capture_decode()`), a batch of one adapter decodes through a step traced once and replayed
        (masgraph/backends/hf/captured.py: a CUDA graph on a GPU) instead of the eager loop. Off by default: made
        for a GPU's host-bound decode and not yet measured on one."""
        self.versions: dict[str | None, int] = {None: 0}
        """Adapter -> the version this backend serves (what completions are stamped with)."""
        # seedless requests only (the scheduler seeds every one); on the model's device, as multinomial needs
        self._rng = torch.Generator(device=self.weights.device).manual_seed(seed)
        self._prefix_kv: dict[tuple, Any] = {}
        self._batch_stop = threading.local()  # .event: the stop flag of the batch this thread runs, if any
        self._streamed: dict[int, TokenText] = {}
        """id(request) -> where its tokens go as they decode, for the requests whose text streams."""
        self._batcher: Batcher[Request, Completion] = Batcher(
            self._run_batch, max_batch_size, batch_wait_ms, thread_name="masgraph-hf",
            error=_generate_error)
        self.stats = {"batches": 0, "rows": 0, "generated_tokens": 0, "generate_s": 0.0,
                      "prefix_hits": 0, "prefix_misses": 0, "prompt_tokens_shared": 0,
                      "prompt_tokens": 0, "prompt_tokens_computed": 0, "prompt_positions_run": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "decode_loops": 0}
        """Counters since the backend started. Where rollout time goes: `prompt_tokens` received vs
        `prompt_tokens_computed` (run through the model: what the cached static prefixes and the shared prompt
        parts saved), `prompt_positions_run` (those and the left padding beside them: what the passes ran),
        `prefill_s` (prompt tokens through the model, with each batch's first pick) vs `decode_s` (the one-token
        steps after); `generate_s` is their sum plus encoding and bookkeeping. `decode_loops`: the
        decode loops the batches ran (`one_loop_per` says which rows share one; rows / decode_loops is the
        batch size decoding saw)."""

    # the served model, read-only (tests and benchmarks inspect it; trainers go through a Learner)
    model_name = property(lambda self: self.weights.name)
    tokenizer = property(lambda self: self.weights.tokenizer)
    dtype = property(lambda self: self.weights.dtype)
    device = property(lambda self: self.weights.device)
    model = property(lambda self: self.weights.model)
    base_model = property(lambda self: self.weights.base_model)
    pad_id = property(lambda self: self.layout.pad_id)
    max_context = property(lambda self: self.layout.max_context)

    # ---- adapters -------------------------------------------------------------------------------
    def publish(self, adapter: str, version: int, source: AdapterSource) -> None:
        """Serve `version` of `adapter` from now on (the weight-sync step; call it between rollouts). From the
        learner's own `HFModel` the weights are already in place, so this is a version bump that drops the
        adapter's cached prefix KV; from elsewhere they are loaded from the source's saved PEFT directory."""
        if source.home is not self.weights:
            with tempfile.TemporaryDirectory(prefix="masgraph-publish-") as tmp:
                try:
                    self.weights.load_adapter(adapter, source.save(tmp))
                except BackendError:  # nothing half-loaded is served
                    self.versions.pop(adapter, None)
                    self._drop_prefix_kv(adapter)
                    raise
        elif adapter not in self.weights.adapters():
            raise BackendError(f"cannot publish adapter {adapter!r}: it is not on {self.model_name}; fix: add it "
                               "to the learner (add_adapter) before publishing")
        self._set_version(adapter, version)

    def has_adapter(self, name: str) -> bool:
        """Whether adapter `name` is served (added, loaded or published)."""
        return name in self.versions

    def add_adapter(self, name: str, lora: LoraConfigSpec | None = None) -> None:
        """Serve adapter `name` at version 0, attaching a fresh (zero-effect) one unless the model has it."""
        if name not in self.weights.adapters():
            self.weights.add_adapter(name, lora)
        self._set_version(name, 0)

    def load_adapter(self, name: str, path: str) -> None:
        """Serve a saved PEFT adapter directory under `name`, in the LoRA shape it was saved with (see
        `HFModel.load_adapter`); a reload is the next version. Every LoRA weight must load, else BackendError
        (and no adapter `name` is left loaded)."""
        try:
            self.weights.load_adapter(name, path)
        except BackendError:  # requests naming it fail as "not loaded"; its versions restart
            self.versions.pop(name, None)
            self._drop_prefix_kv(name)
            raise
        self._set_version(name, self.versions[name] + 1 if name in self.versions else 0)

    def _set_version(self, name: str, version: int) -> None:
        self.versions[name] = version
        self._drop_prefix_kv(name)  # the cached prefix KV was computed with the old weights

    def _drop_prefix_kv(self, adapter: str | None) -> None:
        self._prefix_kv = {k: kv for k, kv in self._prefix_kv.items() if k[0] != adapter}

    # ---- serving --------------------------------------------------------------------------------
    async def complete(self, requests: list[Request]) -> list[Completion]:
        """Completions of `requests` (batched with every other caller's); a request whose text streams (see
        masgraph/streaming.py) has its tokens sent to its sink as they decode."""
        release_team()  # this (event loop) thread's OpenMP workers go while the batcher's thread decodes (threads.py)
        streamed = {}
        for r in requests:
            if (sink := sink_for(r)) is not None:
                streamed[id(r)] = TokenText(asyncio.get_running_loop(), self.tokenizer, self.layout.eos_ids, sink)
        if not streamed:
            return await self._batcher.submit(requests)
        self._streamed.update(streamed)
        try:
            return await self._batcher.submit(requests)
        finally:
            for key in streamed:
                self._streamed.pop(key, None)

    async def aclose(self) -> None:
        await self._batcher.aclose()

    def _run_batch(self, requests: list[Request], stop: threading.Event) -> list[Completion]:
        """One batch from the batcher; in deterministic mode its rows go in key order, whatever their arrival.
        `stop` set ends it at its next decode step (`Stopped`); it reaches `generate` through a thread-local, so
        `generate(requests)` keeps its shape (callers and tests wrap it)."""
        self._batch_stop.event = stop
        try:
            return self._generate_in_order(requests)
        finally:
            self._batch_stop.event = None

    def _generate_in_order(self, requests: list[Request]) -> list[Completion]:
        if not self.deterministic:
            return self.generate(requests)
        order = sorted(range(len(requests)), key=lambda i: sortable(requests[i].key))
        results = self.generate([requests[i] for i in order])
        out: list[Completion] = [None] * len(requests)  # type: ignore[list-item]
        for i, res in zip(order, results):
            out[i] = res
        return out

    def encode(self, messages: list[dict[str, str]], max_new_tokens: int) -> tuple[list[int], bool]:
        """Chat-template token ids of a prompt, middle-truncated to fit the context with room to answer."""
        return self.layout.encode(messages, max_new_tokens)

    @torch.inference_mode()
    def generate(self, requests: list[Request], stop: threading.Event | None = None) -> list[Completion]:
        """Decode a batch of requests (blocking). Its rows decode together as `one_loop_per` says (one at a time in
        deterministic mode), whatever their static prompt prefixes (their cached KVs stacked, left-padded), the rest
        of each prompt left-padded and KV-cached. `stop` (default: the batcher's, when run from it) set ends the
        batch at its next decode step with `Stopped`."""
        # its sums in one order whatever the load; its OpenMP workers let go at the end (masgraph/threads.py)
        with full_threads(self.deterministic), released_team():
            return self._generate(requests, stop)

    def _generate(self, requests: list[Request], stop: threading.Event | None) -> list[Completion]:
        if stop is None:
            stop = getattr(self._batch_stop, "event", None)
        t0 = time.perf_counter()
        fit_threads()  # the prefills before the decode loop (which fits them per step)
        encoded = [self.layout.encode(r.messages, r.sampling.max_tokens) for r in requests]
        prompts = [ids for ids, _ in encoded]
        prefixes = [() if encoded[i][1] else self.layout.static_prefix(r.messages, prompts[i])
                    for i, r in enumerate(requests)]
        per = self.one_loop_per
        if per == "batch" and self.weights.model.training:  # PEFT mixes adapters in eval mode only
            per = "adapter"
        loop = {"batch": lambda i: (), "adapter": lambda i: (requests[i].adapter,),
                "prefix": lambda i: (requests[i].adapter, prefixes[i])}[per]
        # a windowed model whose window a row's pad gap could reach: rows of one prefix and prompt length only (no gap;
        # the layout's length bounded by prefix + shared middle + the rest, each part at most its longest + completion)
        suffix = max(len(p) - len(x) for p, x in zip(prompts, prefixes))
        gapless = not gaps_fit(self.model.config, max(map(len, prefixes)) + 2 * suffix
                               + max(r.sampling.max_tokens for r in requests))
        groups: dict[tuple, list[int]] = {}
        for i in range(len(requests)):
            groups.setdefault(loop(i) + ((prefixes[i], len(prompts[i])) if gapless else ()), []).append(i)
        decoded: dict[int, tuple[list[int], list[float], str]] = {}
        together: dict[int, int] = {}
        for rows in groups.values():
            for chunk in ([[i] for i in rows] if self.deterministic else [rows]):  # batch 1: batch-invariant
                outs = self._decode([prefixes[i] for i in chunk], [prompts[i][len(prefixes[i]):] for i in chunk],
                                    [requests[i] for i in chunk], stop, share=not gapless)
                decoded.update(zip(chunk, outs))
                together.update((i, len(chunk)) for i in chunk)
        results = []
        eos = self.layout.eos_ids
        for i, r in enumerate(requests):
            ids, lps, finish = decoded[i]
            text_ids = ids[:-1] if ids and ids[-1] in eos else ids
            results.append(Completion(
                text=self.tokenizer.decode(text_ids, skip_special_tokens=True), prompt_ids=prompts[i],
                completion_ids=ids, logprobs=lps, finish_reason=finish, prompt_truncated=encoded[i][1],
                policy_version=self.versions.get(r.adapter, 0), batch_size=together[i]))
        self.stats["batches"] += 1
        self.stats["rows"] += len(requests)
        self.stats["prompt_tokens"] += sum(map(len, prompts))
        self.stats["generated_tokens"] += sum(len(c.completion_ids) for c in results)
        self.stats["generate_s"] += time.perf_counter() - t0
        return results

    def capture_decode(self, backend: str | None = None) -> None:
        """Decode one-adapter batches through a traced, replayed step from now on (`captured`), in its first
        shapes (masgraph/backends/hf/captured.py); `backend`: torch.compile's (default: inductor's CUDA graphs on a
        GPU, the traced step run eagerly elsewhere). A model with sliding-window layers is refused (MasgraphError)."""
        self.captured = CapturedDecoder(self.model, backend)

    def _check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.versions:
            raise BackendError(f"adapter {adapter!r} is not loaded on {self.model_name}; loaded: "
                               f"{sorted(k for k in self.versions if k)}")

    def _prefix_cache(self, prefix: tuple[int, ...], adapter: str | None) -> Any:
        """KV cache of a static prefix at batch 1 (LRU of 16; keyed by adapter version, so an update
        of the adapter's weights invalidates it)."""
        key = (adapter, self.versions.get(adapter, 0), prefix)
        cache = self._prefix_kv.pop(key, None)
        if cache is None:
            t0 = time.perf_counter()
            cache = prefill(self.model, prefix)
            self.stats["prefill_s"] += time.perf_counter() - t0
            self.stats["prefix_misses"] += 1
            self.stats["prompt_tokens_computed"] += len(prefix)
            self.stats["prompt_positions_run"] += len(prefix)
        else:
            self.stats["prefix_hits"] += 1
        self._prefix_kv[key] = cache  # most recently used last
        while len(self._prefix_kv) > 16:
            self._prefix_kv.pop(next(iter(self._prefix_kv)))
        return cache

    def _decode(self, prefixes: list[tuple[int, ...]], suffixes: list[list[int]], requests: list[Request],
                stop: threading.Event | None = None, share: bool = True) -> list[tuple[list[int], list[float], str]]:
        """Decode rows whose prompts are `prefixes[i]` (a static prefix whose KV is cached per adapter; may be
        empty) + `suffixes[i]`, each under its request's adapter; `share`: prefill prompt parts rows share once."""
        from transformers import DynamicCache

        device = self.weights.device
        B = len(suffixes)
        adapters = [r.adapter for r in requests]
        for adapter in set(adapters):
            self._check_adapter(adapter)
        if self.captured is not None and len(set(adapters)) == 1:
            done = self._decode_captured([list(p) + s for p, s in zip(prefixes, suffixes)], requests, stop)
            if done is not None:  # None: a shape past the captured ones, decoded below
                return done
        histories = list(zip(adapters, prefixes))  # what each row's cached KV was computed from
        distinct = list(dict.fromkeys(histories))
        # rows whose prompts share more than their static prefix (a question's samples, an episode's next turn) have
        # that part prefilled once per cluster, its KV picked for every row of the cluster (learn/packing.py's rule)
        cluster, shared = list(range(B)), [0] * B
        if share and self.share_prompts and B > 1 and min(map(len, suffixes)) > 1:
            base = 0
            for h in distinct:  # within one history only: rows on another prefix or adapter attend other KV
                rows = [i for i in range(B) if histories[i] == h]
                ids, lengths = share_middles([suffixes[i][:-1] for i in rows])
                for i, c, n in zip(rows, ids, lengths):
                    cluster[i], shared[i] = base + c, n
                base += max(ids) + 1
        clusters = max(cluster) + 1
        if clusters == B:  # nothing shared: one cache row per request row, in row order
            cluster, shared = list(range(B)), [0] * B
        firsts = [cluster.index(c) for c in range(clusters)]
        mixed = len(set(adapters)) > 1
        cached = {}
        for adapter, prefix in distinct:
            if prefix:
                with self.weights.use(adapter):
                    cached[adapter, prefix] = self._prefix_cache(prefix, adapter)
        past_mask, cascade = None, None
        if cached and self.cascade:  # the prefixes attended where they are; the cache holds the rows' own positions
            cache = DynamicCache()
            if len(distinct) == 1:
                prefix_kv = cached[distinct[0]]
                prefix_mask = torch.ones((1, len(distinct[0][1])), dtype=torch.bool, device=device)
            else:
                prefix_kv, prefix_mask = stack_prefixes([cached.get(h) for h in distinct],
                                                        [len(h[1]) for h in distinct], device)
            cascade = Cascade(prefix_kv, prefix_mask, [[c for c in range(clusters) if histories[firsts[c]] == h]
                                                       for h in distinct],
                              [len(prefixes[k]) for k in firsts], device)
        elif not cached:  # no row has a cached prefix: the cache starts empty
            cache = DynamicCache()
        elif len(distinct) == 1:  # one history: its KV broadcast to the clusters
            cache = copy.deepcopy(cached[distinct[0]])
            if clusters > 1:
                cache.batch_repeat_interleave(clusters)
        else:  # rows on different histories: their KVs stacked, left-padded (one row per cluster)
            cache, past_mask = stack_prefixes([cached.get(histories[k]) for k in firsts],
                                              [len(prefixes[k]) for k in firsts], device)
        # one adapter: the model runs under it; several: each forward pass names every row's (PEFT's mixed batch)
        names = {"adapter_names": [a if a is not None else "__base__" for a in adapters]} if mixed else {}
        with contextlib.nullcontext() if mixed else self.weights.use(adapters[0]):
            return self._decode_rows(cache, past_mask, prefixes[0], cluster, shared, firsts, suffixes, requests,
                                     names, stop, cascade)

    def _decode_rows(self, cache: Any, past_mask: torch.Tensor | None, prefix: tuple[int, ...], cluster: list[int],
                     shared: list[int], firsts: list[int], suffixes: list[list[int]], requests: list[Request],
                     names: dict[str, Any], stop: threading.Event | None, cascade: Cascade | None = None
                     ) -> list[tuple[list[int], list[float], str]]:
        """The shared prompt parts (one row per cluster), then every row's own prompt and completion."""
        B = len(suffixes)
        clusters = len(firsts)
        if clusters < B:
            t0 = time.perf_counter()
            past_mask, run = prefill_shared(self.model, cache, past_mask, len(prefix),
                                            [suffixes[k][:shared[k]] for k in firsts], cluster, self.pad_id, cascade,
                                            {k: [v[i] for i in firsts] for k, v in names.items()}, self.pass_overhead)
            suffixes = [x[n:] for x, n in zip(suffixes, shared)]
            self.stats["prefill_s"] += time.perf_counter() - t0
            self.stats["prompt_tokens_computed"] += sum(shared[k] for k in firsts)
            self.stats["prompt_positions_run"] += run
            self.stats["prompt_tokens_shared"] += sum(shared) - sum(shared[k] for k in firsts)
        gens, on_token = self._row_sources(requests)
        self.stats["prompt_tokens_computed"] += sum(map(len, suffixes))
        self.stats["decode_loops"] += 1
        return decode(self.model, cache, len(prefix), suffixes, requests, gens, self.pad_id, self.layout.eos_ids,
                      stop, on_token, past_mask, self.stats, names, cascade, self.pass_overhead, self.drop_finished)


    def _decode_captured(self, prompts: list[list[int]], requests: list[Request], stop: threading.Event | None
                         ) -> list[tuple[list[int], list[float], str]] | None:
        """Rows of one adapter, each prompt whole, through the captured step (`captured`); None where it declines
        the batch's shape."""
        assert self.captured is not None
        gens, on_token = self._row_sources(requests)
        with self.weights.use(requests[0].adapter):
            done = self.captured.decode(prompts, requests, gens, self.pad_id, self.layout.eos_ids, stop, on_token,
                                        self.stats)
        if done is not None:
            self.stats["prompt_tokens_computed"] += sum(map(len, prompts))
            self.stats["decode_loops"] += 1
        return done

    def _row_sources(self, requests: list[Request]) -> tuple[list[torch.Generator], list | None]:
        """Each row's generator (its seed's, or the backend's) and token sink (None where nothing streams)."""
        device = self.weights.device
        gens = [torch.Generator(device=device).manual_seed(r.seed) if r.seed is not None else self._rng
                for r in requests]
        streamed = [self._streamed.get(id(r)) for r in requests]
        return gens, [t.token if t is not None else None for t in streamed] if any(streamed) else None


def _generate_error(exc: Exception) -> BackendError:
    """What a failed batch tells each of its calls; out of device memory names the knobs that shrink a batch."""
    from masgraph.device import is_out_of_memory

    if is_out_of_memory(exc):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what the failed batch held goes back for the next one
        return BackendError(f"hf generate ran out of device memory ({type(exc).__name__}); fix: fewer episodes in "
                            "flight (--concurrency / train.concurrency), a smaller `max_tokens`, or a smaller "
                            "batch (BackendOptions.max_batch_size)")
    return BackendError(f"hf generate failed: {type(exc).__name__}: {exc}")
