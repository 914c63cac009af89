"""The topology policy: a small parametric distribution over a graph's topology decisions.

Each decision d has logits θ_d (one per option); with query conditioning they become θ_d + W_d·φ(q), φ the query
features and W zero-initialised (training starts from the unconditioned prior). Decisions are sampled in order;
at each one the options no valid completion allows get logit −∞ (`DecisionSpace.allowed`), so

    log π(G | q) = Σ_{d made} log softmax(masked logits_d)[option_d],

the sum over the decisions actually made (skipped ones contribute nothing). `log_probs` recomputes those terms
with gradient for the trainer, along the recorded path, with the same masks.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from masgraph.errors import MasgraphError
from masgraph.graph import Graph, Topology
from masgraph.graph.space import DecisionSpace
from masgraph.rundir.checkpoint import TOPOLOGY_FILE
from masgraph.topology.features import HASHED_DIM, hashed_features
from masgraph.trace import TopologyChoice


@dataclass
class Sampled:
    """A sampled topology: the sub-graph to run and the record for the trace."""

    topology: Topology
    choice: TopologyChoice


class TopologyPolicy(torch.nn.Module):
    """Logits per decision, optionally a linear head on query features; samples valid topologies.

    Example:
        >>> policy = TopologyPolicy(DecisionSpace(graph))
        >>> s = policy.sample("What is 2 + 3?", seed=0)
        >>> s.choice.decisions, s.choice.logprob
    """

    def __init__(self, space: DecisionSpace, condition: str = "none", init: dict[str, dict[str, float]] | None = None,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.space = space
        self.conditioned = condition == "query"
        sizes = [len(d.options) for d in space.decisions]
        # a few hundred numbers: the CPU by default, whatever device the LLM is on
        self.logits = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(k, device=device)) for k in sizes])
        self.head = torch.nn.Linear(HASHED_DIM, sum(sizes), bias=False, device=device) if self.conditioned else None
        if self.head is not None:
            torch.nn.init.zeros_(self.head.weight)
        self._splits = sizes
        self.version = 0
        """Update count (set by the trainer); stamped on every sample."""
        for name, probs in (init or {}).items():  # a prior: initial option probabilities of some decisions
            k = [d.name for d in space.decisions].index(name)
            p = torch.tensor([probs.get(o, 0.0) for o in space.decisions[k].options],
                             device=self.device).clamp_min(1e-6)
            with torch.no_grad():
                self.logits[k].copy_(torch.log(p / p.sum()))

    @property
    def device(self) -> torch.device:
        """Where the parameters live (the CPU unless moved: the policy is a few hundred numbers)."""
        return self.logits[0].device if len(self.logits) else torch.device("cpu")  # no decisions: nothing runs

    def features(self, query: str) -> torch.Tensor | None:
        """φ(q) when conditioned, else None."""
        return hashed_features(query, device=self.device) if self.conditioned else None

    def decision_logits(self, features: torch.Tensor | None) -> list[torch.Tensor]:
        """Unmasked logits of every decision (with gradient)."""
        base = list(self.logits)
        if self.head is None or features is None:
            return base
        shift = torch.split(self.head(features), self._splits)
        return [b + s for b, s in zip(base, shift)]

    @torch.no_grad()
    def sample(self, query: str, seed: int | None = None, greedy: bool = False) -> Sampled:
        """One valid topology for `query`: each decision sampled (or its most likely allowed option when
        `greedy`) from its masked distribution; skipped decisions take their first allowed option."""
        gen = torch.Generator(device=self.device).manual_seed(seed if seed is not None
                                            else zlib.crc32(query.encode("utf-8", "surrogatepass")))
        logits = self.decision_logits(self.features(query))
        if not all(bool(torch.isfinite(lg).all()) for lg in logits):
            raise MasgraphError(f"the topology policy (v{self.version}) has non-finite parameters; it cannot sample "
                                "(a diverged update: lower `hrpo.lr`, or load an earlier checkpoint)")
        config: list[int] = []
        logprobs: dict[str, float] = {}
        for d, lg in zip(self.space.decisions, logits):
            prefix = tuple(config)
            mask = self.space.allowed(prefix)
            if self.space.skipped(prefix):
                config.append(mask.index(True))
                continue
            logp = _masked_log_softmax(lg, mask)
            o = int(logp.argmax()) if greedy else int(torch.multinomial(logp.exp(), 1, generator=gen))
            config.append(o)
            logprobs[d.name] = float(logp[o])
        cfg = tuple(config)
        decisions = {d.name: d.options[o] for d, o in zip(self.space.decisions, cfg)}
        return Sampled(self.space.topology(cfg), TopologyChoice(decisions=decisions, logprobs=logprobs,
                                                                 version=self.version,
                                                                 mode="greedy" if greedy else "sample"))

    def log_probs(self, query: str, choice: TopologyChoice) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """The decisions made in `choice` (in order), their log-probabilities under the current parameters and
        their masked distributions' entropies (both with gradient)."""
        config = self.space.config_of(choice.decisions)
        logits = self.decision_logits(self.features(query))
        names, lps, ents = [], [], []
        for k, (d, lg) in enumerate(zip(self.space.decisions, logits)):
            prefix = config[:k]
            mask = self.space.allowed(prefix)
            if not mask[config[k]]:
                raise MasgraphError(f"topology decision {d.name}={d.options[config[k]]!r} after "
                                    f"{dict(zip((e.name for e in self.space.decisions), prefix))} is not a valid "
                                    "graph; these decisions were not sampled from this graph's space")
            if self.space.skipped(prefix):
                continue
            logp = _masked_log_softmax(lg, mask)
            names.append(d.name)
            lps.append(logp[config[k]])
            p = logp.exp()
            ents.append(-(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum())
        if not names:
            return [], torch.zeros(0, device=self.device), torch.zeros(0, device=self.device)
        return names, torch.stack(lps), torch.stack(ents)

    def signature(self) -> list[list]:
        """The decisions and their options, in order: what a saved policy must match to be loaded."""
        return [[d.name, list(d.options)] for d in self.space.decisions]

    def probabilities(self, query: str | None = None) -> dict[str, dict[str, float]]:
        """Each decision's option probabilities (softmax of its logits, before masking; given `query` when
        conditioned): what `masgraph topology` prints and metrics record."""
        with torch.no_grad():
            logits = self.decision_logits(self.features(query) if query is not None else None)
        return {d.name: dict(zip(d.options, torch.softmax(lg, -1).tolist()))
                for d, lg in zip(self.space.decisions, logits)}


def _masked_log_softmax(logits: torch.Tensor, mask: list[bool]) -> torch.Tensor:
    """log softmax over the allowed options; −inf for the others."""
    allowed = torch.tensor(mask, device=logits.device)
    return torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1)


def load_policy(graph: Graph, checkpoint: Path | None = None) -> TopologyPolicy | None:
    """The topology policy of a graph with a `topology:` section (None without one): the learned one saved in
    `checkpoint` when it holds one, else the untrained, uniform prior."""
    if graph.spec.topology is None:
        return None
    policy = TopologyPolicy(DecisionSpace(graph), graph.spec.topology.condition)
    path = checkpoint / TOPOLOGY_FILE if checkpoint is not None else None
    if path is not None and path.exists():
        fix = "it must come from training this graph (pass another RUN/checkpoints/step-N)"
        try:
            # plain tensors and numbers: no pickled code runs; read onto the CPU whatever device saved it
            state = torch.load(path, weights_only=True, map_location="cpu")
            check_signature(state, policy, path)
            policy.load_state_dict(state["policy"])
            policy.version = state["version"]
        except MasgraphError:
            raise
        except Exception as exc:  # truncated, foreign or another graph's: torch raises several kinds
            raise MasgraphError(f"cannot load the topology policy from {path} ({type(exc).__name__}: {exc}); "
                                f"{fix}") from exc
        if not isinstance(policy.version, int) or isinstance(policy.version, bool) or policy.version < 0:
            raise MasgraphError(f"{path}: version {policy.version!r} is not a step count; {fix}")
        if not all(bool(torch.isfinite(p).all()) for p in policy.parameters()):
            raise MasgraphError(f"{path}: the topology policy's parameters are not finite (a diverged update); "
                                "pass an earlier RUN/checkpoints/step-N")
    return policy


def check_signature(state: dict, policy: TopologyPolicy, path: Path | str) -> None:
    """A saved topology state belongs to this graph: same decisions, same options, in the same order (a graph
    edited since training could otherwise load weights for the wrong options, silently)."""
    saved = state.get("decisions") if isinstance(state, dict) else None
    if saved is not None and saved != policy.signature():
        raise MasgraphError(f"{path} was trained on topology decisions {saved}, but this graph has "
                            f"{policy.signature()}; run it with the graph it was trained with")

