"""The backend contract: `async complete(requests) -> completions`, with token ids and logprobs when it can.

`Completion` (what came back) is declared in masgraph/trace.py, as the base of the trace's `LLMCall`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from masgraph.errors import MasgraphError
from masgraph.spec import SamplingSpec
from masgraph.trace import COMPLETION_FIELDS, Completion, LLMCall, unvalidated


@dataclass
class LoraConfigSpec:
    """LoRA shape of one named adapter."""

    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    """Modules that get LoRA, fitted to the architecture when the adapter is attached
    (`masgraph.backends.hf.lora_targets.resolve_targets`: Phi3's fused `qkv_proj` for q_proj/v_proj, ...);
    `("all-linear",)` for every linear layer but the output head."""
    dropout: float = 0.0


class TokenRow(Protocol):
    """What a logprob pass needs of a training row: the exact token ids and the softmax temperature."""

    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float


class AdapterSource(Protocol):
    """One adapter's current weights, in whichever form a receiver takes them."""

    home: object
    """The object the weights live in; an in-process receiver that serves from the same one needs no copy."""

    def save(self, path: str) -> str:
        """Write the adapter as a PEFT directory (adapter_config.json + adapter_model.safetensors); its path."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The adapter's weights by PEFT key (for an object store)."""
        ...


@dataclass
class Request:
    """One chat completion request from one node step."""

    messages: list[dict[str, str]]
    policy: str = "default"
    adapter: str | None = None
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    seed: int | None = None
    """Per-request sampling seed (deterministic mode); None draws from the backend's generator."""
    key: tuple = ()
    """Stable ordering key (episode, node, turn) used to order batches deterministically."""


def llm_call(req: Request, c: Completion, latency_s: float, queue_s: float = 0.0) -> LLMCall:
    """The trace's record of one call: what came back (`c`, as is: a Completion was validated when it was built)
    and what was asked (`req`: policy, adapter, sampling)."""
    sampling = req.sampling
    return unvalidated(LLMCall, {**c.__dict__, "policy": req.policy, "adapter": req.adapter,
                                 "temperature": sampling.temperature, "top_p": sampling.top_p,
                                 "latency_s": latency_s, "queue_s": queue_s, "parse_error": None})


def replayed(call: LLMCall) -> Completion:
    """`llm_call`'s inverse: a recorded call as the completion a node receives (a branched sibling's prefix, which
    is replayed, not decoded)."""
    d = call.__dict__
    return unvalidated(Completion, {k: d[k] for k in COMPLETION_FIELDS})


class BackendError(MasgraphError, RuntimeError):
    """The backend failed to serve a request (the step fails and is recorded; the run goes on), or could not
    load what it was given (an adapter checkpoint): a user-facing error whose message says what to fix."""


class Backend(Protocol):
    """Serves completions for many episodes at once."""

    returns_tokens: bool

    async def complete(self, requests: list[Request]) -> list[Completion]: ...

    async def aclose(self) -> None: ...


class SyncedBackend(Backend, Protocol):
    """A backend that serves the adapter versions a learner publishes (see `masgraph.learner.WeightSync`)."""

    def publish(self, adapter: str, version: int, source: AdapterSource) -> None:
        """Serve `version` of `adapter` from now on, its weights read from `source` unless already in place
        (in process, on the learner's own model). Called between rollouts; may block."""
        ...


class AdapterBackend(Backend, Protocol):
    """A backend that serves named LoRA adapters of its base model (hf today): what `Engine` uses to serve a
    graph's untrained adapters and a checkpoint's trained ones."""

    def has_adapter(self, name: str) -> bool: ...

    def add_adapter(self, name: str) -> None:
        """Serve a fresh (zero-effect) adapter `name`."""
        ...

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the saved PEFT directory `path` as adapter `name` (strictly, in its saved LoRA shape)."""
        ...


def serves_adapters(backend: Backend) -> bool:
    """Whether `backend` implements AdapterBackend."""
    return all(callable(getattr(backend, m, None)) for m in ("has_adapter", "add_adapter", "load_adapter"))


def truncate_middle(ids: list[int], budget: int, marker: list[int]) -> tuple[list[int], bool]:
    """The context rule: keep the first quarter of the budget (system prompt, task, query) and the rest
    from the end (latest memory and the assistant header), joined by `marker`; drop the middle."""
    if len(ids) <= budget:
        return ids, False
    head = budget // 4
    tail = budget - head - len(marker)
    return ids[:head] + marker + ids[len(ids) - tail:], True
