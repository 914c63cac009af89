"""vLLM backend: rollouts and serving through vLLM's OpenAI-compatible server, token-exact.

Prompts go out as token ids (our chat template and context rule, the same `TokenLayout` as the hf backend), and the
sampled ids and their logprobs come back (`return_token_ids`, `logprobs: 0`, the server in `processed_logprobs`
mode: after temperature, as the trainer recomputes them), so the trainer never re-tokenises. Trained adapters are
named LoRA adapters loaded at run time: each published version under its own name (`planner-v3-<digest>`), the stale
one unloaded after the new one loads. The server is attached by URL (`api_base:`) or started and stopped here
(`VLLMServer`)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from masgraph.backends.base import BackendError, Completion, Request
from masgraph.backends.vllm_server import VLLMServer
from masgraph.workclock import Queued

if TYPE_CHECKING:
    from masgraph.backends.base import AdapterSource, LoraConfigSpec


class VLLMBackend:
    """Serves completions from a vLLM server (continuous batching happens there: requests go out concurrently).

    `api_base` attaches to a running server (it must serve `model` and load adapters from paths this process
    writes: the same machine or a shared filesystem); without it a server is started on 127.0.0.1, its log in
    `log_dir` (the run dir) as vllm-server.log, and stopped by `aclose`. `model` must also be local here (its
    tokenizer builds the prompt ids).

    With top_p < 1 the recorded logprobs are renormalised over the nucleus (vLLM's processed logprobs), unlike the
    hf backend's; training samples at top_p 1, where the two agree. `deterministic` sends one request at a time
    (vLLM's numerics depend on the batch) with per-request seeds.

    Example:
        >>> b = VLLMBackend("smollm2-135m", log_dir="runs/x")           # starts a server (~30 s on a CPU)
        >>> [c] = asyncio.run(b.complete([Request([{"role": "user", "content": "Hi"}])]))
        >>> len(c.completion_ids) == len(c.logprobs)
        True
    """

    returns_tokens = True

    def __init__(self, model: str = "smollm2-135m", api_base: str | None = None, dtype: str = "auto",
                 seed: int = 0, max_context: int = 2048, log_dir: str | Path | None = None,
                 deterministic: bool = False, max_loras: int = 4, max_lora_rank: int = 16, timeout_s: float = 300.0):
        import httpx
        from transformers import AutoTokenizer

        from masgraph.backends.hf.layout import TokenLayout
        from masgraph.model import resolve_model

        model_dir = resolve_model(model)
        self.layout = TokenLayout(AutoTokenizer.from_pretrained(str(model_dir)), max_context)
        self.model_name, self.deterministic, self.timeout_s = model, deterministic, timeout_s
        self.dtype = _dtype_name(dtype)
        self.server: VLLMServer | None = None
        self._tmp = Path(tempfile.mkdtemp(prefix="masgraph-vllm-"))
        if api_base is None:
            log_path = Path(log_dir or self._tmp) / "vllm-server.log"
            self.server = VLLMServer(model_dir, model, log_path, self.dtype, seed, max_lora_rank, max_loras,
                                     max_context)
            self.server.start()
            api_base = self.server.url
        self.api_base = api_base.rstrip("/")
        self._sync = httpx.Client(base_url=self.api_base, timeout=timeout_s)
        self._client: tuple[Any, Any] | None = None  # (event loop, httpx.AsyncClient): a client serves one loop
        self.served_model = self._find_served_model(model)
        self.versions: dict[str | None, int] = {None: 0}
        """Adapter -> the version served (completions are stamped with it)."""
        self.lora_names: dict[str, str | None] = {}
        """Adapter -> its name on the server (None: a fresh adapter, served by the base model it equals)."""
        self._owned: dict[str, Path] = {}  # server name -> the adapter directory we wrote for it
        self._one_at_a_time = asyncio.Semaphore(1) if deterministic else None
        self.stats = {"requests": 0, "generated_tokens": 0, "prompt_tokens": 0, "publishes": 0}

    tokenizer = property(lambda self: self.layout.tokenizer)

    def _find_served_model(self, model: str) -> str:
        """The server's name for the base model: `model` if it serves that name, else the one it serves."""
        try:
            ids = [m["id"] for m in self._get_json("/models")["data"] if m.get("parent") is None]
        except (KeyError, TypeError, AttributeError):
            raise BackendError(f"{self.api_base}/models did not list models; is it a vLLM server?") from None
        if model in ids or not ids:
            return model
        return ids[0]

    # ---- adapters (the weight-sync step) ------------------------------------------------------------
    def has_adapter(self, name: str) -> bool:
        return name in self.versions

    def add_adapter(self, name: str, lora: LoraConfigSpec | None = None) -> None:
        """Serve a fresh adapter `name` at version 0: a zero-effect LoRA equals the base model, which serves it."""
        self._drop_lora(name)
        self.versions[name], self.lora_names[name] = 0, None

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the saved PEFT directory `path` as adapter `name` (a reload is the next version)."""
        version = self.versions[name] + 1 if name in self.versions else 0
        self._serve(name, version, Path(path).absolute())

    def publish(self, adapter: str, version: int, source: AdapterSource) -> None:
        """Serve `version` of `adapter` from now on: the learner's weights saved as a PEFT directory, loaded by the
        server under a new name, then the stale version unloaded. Call it between rollouts."""
        target = self._tmp / f"{adapter}-v{version}"
        shutil.rmtree(target, ignore_errors=True)
        self._serve(adapter, version, Path(source.save(str(target))).absolute(), owned=True)
        self.stats["publishes"] += 1

    def _serve(self, adapter: str, version: int, path: Path, owned: bool = False) -> None:
        """Load `path` as the adapter's new version under a content-addressed name (`planner-v3-1a2b3c4d`): on a
        server shared by several clients (Ray workers) the same weights load once, and a name left loaded by an
        earlier run can never stand for other weights."""
        new = f"{adapter}-v{version}-{_digest(path)}"
        if self.lora_names.get(adapter) == new:
            return
        self._post("/load_lora_adapter", {"lora_name": new, "lora_path": str(path)},
                   f"cannot load adapter {adapter!r} version {version} from {path}", ok_if="has already been loaded")
        self._drop_lora(adapter)
        self.versions[adapter], self.lora_names[adapter] = version, new
        if owned:
            self._owned[new] = path

    def _drop_lora(self, adapter: str) -> None:
        """Unload the adapter's served version (if any) and delete the directory we wrote for it."""
        old = self.lora_names.pop(adapter, None)
        if old is None:
            return
        self._post("/unload_lora_adapter", {"lora_name": old}, f"cannot unload {old!r}", missing_ok=True)
        path = self._owned.pop(old, None)
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    # ---- serving ------------------------------------------------------------------------------------
    async def complete(self, requests: list[Request]) -> list[Completion]:
        return list(await asyncio.gather(*(self._one(r) for r in requests)))

    async def _one(self, req: Request) -> Completion:
        if self._one_at_a_time is None:
            return await self._call(req)
        wait = Queued()  # waiting for the gate is queue time, not the node's work (masgraph/workclock.py)
        try:
            await self._one_at_a_time.acquire()
        finally:
            wait.done()
        try:
            return await self._call(req)
        finally:
            self._one_at_a_time.release()

    def payload(self, req: Request) -> tuple[dict[str, Any], list[int], bool]:
        """The /v1/completions body for a request, with its prompt ids and whether they were truncated."""
        if req.adapter is not None and req.adapter not in self.versions:
            raise BackendError(f"adapter {req.adapter!r} is not loaded on {self.model_name}; loaded: "
                               f"{sorted(a for a in self.versions if a)}")
        ids, truncated = self.layout.encode(req.messages, req.sampling.max_tokens)
        s = req.sampling
        body = {"model": (self.lora_names.get(req.adapter) if req.adapter else None) or self.served_model,
                "prompt": ids, "max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                "logprobs": 0, "return_token_ids": True, "stream": False,
                "stop_token_ids": sorted(self.layout.eos_ids - {self.tokenizer.eos_token_id})}
        if req.seed is not None:
            body["seed"] = req.seed
        return body, ids, truncated

    async def _call(self, req: Request) -> Completion:
        import httpx

        body, ids, truncated = self.payload(req)
        version = self.versions.get(req.adapter, 0)
        try:
            resp = await self._async_client().post("/completions", json=body)
        except httpx.HTTPError as exc:
            raise self._failure(exc) from None
        if resp.status_code != 200:
            raise BackendError(f"vllm {self.api_base}: HTTP {resp.status_code}: {_message(resp)}")
        try:
            choice = resp.json()["choices"][0]
            out_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise BackendError(f"vllm {self.api_base}: unexpected completion ({type(exc).__name__}: {exc}); "
                               "the server must be vLLM >= 0.10.2 (return_token_ids)") from None
        if len(logprobs) != len(out_ids):
            raise BackendError(f"vllm {self.api_base}: {len(out_ids)} token ids but {len(logprobs)} logprobs")
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(out_ids)
        self.stats["prompt_tokens"] += len(ids)
        return Completion(text=choice.get("text") or "", prompt_ids=ids, completion_ids=out_ids, logprobs=logprobs,
                          finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
                          prompt_truncated=truncated, policy_version=version)

    def _async_client(self) -> Any:
        """The async client of the running event loop (a new loop, e.g. a second asyncio.run, gets its own)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            self._client = (loop, httpx.AsyncClient(
                base_url=self.api_base, timeout=self.timeout_s,
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64)))
        return self._client[1]

    def _failure(self, exc: Exception) -> BackendError:
        import httpx

        if self.server is not None and not self.server.alive():
            return self.server.died()
        hint = ("; is a vLLM server running there? (without --api-base / `api_base:` masgraph starts one)"
                if self.server is None and isinstance(exc, httpx.ConnectError) else "")
        return BackendError(f"vllm {self.api_base}: {type(exc).__name__}: {exc}{hint}")

    def _get_json(self, path: str) -> Any:
        import httpx

        try:
            resp = self._sync.get(path)
        except httpx.HTTPError as exc:
            raise self._failure(exc) from None
        where = f"vllm {self.api_base}{path}"
        if resp.status_code in (401, 403):
            raise BackendError(f"{where}: HTTP {resp.status_code}: the server wants an API key (started with "
                               "--api-key?); masgraph sends none: start it without one")
        hint = "is it a vLLM server's OpenAI API (http://host:port/v1)?"
        if resp.status_code != 200:
            raise BackendError(f"{where}: HTTP {resp.status_code}; {hint}")
        try:
            return resp.json()
        except ValueError as exc:
            raise BackendError(f"{where}: {exc}; {hint}") from None

    def _post(self, path: str, body: dict[str, Any], what: str, missing_ok: bool = False, ok_if: str = "") -> None:
        import httpx

        try:
            resp = self._sync.post(path, json=body)
        except httpx.HTTPError as exc:
            raise self._failure(exc) from None
        if ok_if and resp.status_code == 400 and ok_if in _message(resp):
            return
        if resp.status_code != 200 and not (missing_ok and resp.status_code == 404):
            hint = (" (start the server with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
                    if resp.status_code == 404 else "")
            raise BackendError(f"{what}: vllm answered HTTP {resp.status_code}: {_message(resp)}{hint}")

    async def aclose(self) -> None:
        if self._client is not None and self._client[0] is asyncio.get_running_loop():
            await self._client[1].aclose()
        self._client = None
        self._sync.close()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        shutil.rmtree(self._tmp, ignore_errors=True)


def _message(resp: Any) -> str:
    try:
        body = resp.json()
        return str(body.get("error", {}).get("message") or body.get("message") or body)[:500]
    except ValueError:
        return resp.text[:500]


def _digest(path: Path) -> str:
    """8 hex digits of the adapter directory's files (names and bytes)."""
    h = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:8]


def _dtype_name(dtype: str) -> str:
    """`auto` -> the dtype the hf backend would pick on this machine (bf16 where it is faster), as vLLM names it."""
    if dtype != "auto":
        return dtype
    from masgraph.backends.hf.dtype import pick_dtype

    return str(pick_dtype()).removeprefix("torch.")
