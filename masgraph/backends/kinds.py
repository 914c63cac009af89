"""The built-in backend kinds (hf, litellm, vllm, scripted), registered through the `masgraph.plugins` entry point
so the core registry imports no concrete backend."""

from __future__ import annotations

from typing import Any

from masgraph.backends.base import Backend
from masgraph.errors import MasgraphError
from masgraph.registry import BackendKind, Registry
from masgraph.spec import PolicySpec


def _hf(policy: PolicySpec, **options: Any) -> Backend:
    from masgraph.backends.hf import HFBackend

    return HFBackend(policy.model, device=policy.device, dtype=policy.dtype, **options)


def _litellm(policy: PolicySpec, **options: Any) -> Backend:
    from masgraph.backends.litellm import LiteLLMBackend

    return LiteLLMBackend(policy.model, api_base=policy.api_base)


def _vllm(policy: PolicySpec, **options: Any) -> Backend:
    from masgraph.backends.vllm import VLLMBackend

    return VLLMBackend(policy.model, api_base=policy.api_base, dtype=policy.dtype, **options)


def _hf_for_learner(policy: PolicySpec | None, learner: Any, deterministic: bool = False, seed: int = 0,
                   replica: bool = False, weights: Any = None, max_batch_size: int = 32, **_: Any) -> Any:
    """An hf backend serving the learner's own weights (publishing a version copies nothing), or with `replica` its
    own copy of the learner's base model, in its dtype and on its device (rollouts that decode while the learner
    updates, or beside a learner sharded across ranks: each published version is loaded into the copy), or that
    copy given as `weights` (another backend's)."""
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.model import HFModel

    own = getattr(learner, "weights", None)
    if not isinstance(own, HFModel):
        raise MasgraphError(f"the hf backend serves an in-process learner's own weights, and "
                            f"{type(learner).__name__} has none; fix: pass `backend=` (what serves the learner's "
                            "adapters to rollouts), or leave both out for the in-process hf pair")
    if replica and weights is None:
        weights = HFModel(own.name, learner.dtype, device=str(own.device))
    return HFBackend(weights if replica else own, deterministic=deterministic, seed=seed,
                     max_batch_size=max_batch_size)


def _vllm_for_learner(policy: PolicySpec | None, learner: Any, deterministic: bool = False, seed: int = 0,
                     log_dir: str | None = None, max_lora_rank: int = 16, **_: Any) -> Any:
    """A vLLM server (started here unless the policy attaches one) in the learner's dtype; each published version
    is loaded by name."""
    from masgraph.backends.vllm import VLLMBackend

    if policy is None:
        raise MasgraphError("no `backend: vllm` policy to serve the learner's adapters from")
    return VLLMBackend(policy.model, policy.api_base, dtype=learner.dtype, seed=seed, log_dir=log_dir,
                       deterministic=deterministic, max_lora_rank=max(16, max_lora_rank))


def _scripted(policy: PolicySpec, **options: Any) -> Backend:
    raise MasgraphError(
        f"a policy uses `backend: scripted` (model {policy.model!r}), which has no built-in instance: it replays "
        "canned replies for tests and has none in a graph file; fix: serve it with `backend: hf` (a local model) "
        "or `backend: litellm` (a server), or run the graph from Python with "
        "Runner(graph, backends={'scripted': ScriptedBackend(...)})")


def register(registry: Registry) -> None:
    """Add the built-in backend kinds to `registry`."""
    registry.backends.update({
        "hf": BackendKind("hf", _hf, returns_tokens=True, local_models=True,
                          options=("deterministic", "max_batch_size", "batch_wait_ms", "seed"),
                          for_learner=_hf_for_learner),
        "litellm": BackendKind("litellm", _litellm, returns_tokens=False),
        "vllm": BackendKind("vllm", _vllm, returns_tokens=True, local_models=True,
                            options=("deterministic", "seed", "log_dir"), for_learner=_vllm_for_learner),
        "scripted": BackendKind("scripted", _scripted, returns_tokens=True),
    })
