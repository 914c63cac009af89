"""The names of a training run's metrics (metrics.jsonl), defined once: namespaced, one estimator per name, and the
aliases that let the readers (watch, plot, the CLI, the bundle) show runs written under the former names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

REWARD = "reward/mean"
"""Mean reward of the step's episodes."""
ACCURACY_TRAIN, ACCURACY_TEST = "accuracy/train", "accuracy/test"
EPISODES_TEST = "episodes/test"
"""Held-out episodes an evaluation ran (fewer than `eval_n` when the task holds out fewer items)."""
LOSS_TOTAL = "loss/total"
"""Flow-GRPO's loss, mean over its optimizer steps."""
LOSS_POLICY = "loss/policy"
CLIP_FRAC = "loss/clip_frac"
"""Share of tokens whose probability ratio fell outside the PPO clip range."""
OPTIMIZER_STEPS = "loss/optimizer_steps"
KL_REF = "kl/ref_k3"
"""k3 estimate of KL(policy || reference), per token: the penalised term."""
KL_OLD = "kl/old_k3"
"""k3 estimate of KL(rollout policy || updated policy), per token: how far an update moved."""
ROWS = "rows/trained"
"""LLM calls trained on."""
TRAJECTORIES = "rows/trajectories"
"""Episodes with at least one trained row."""
SEQUENCES = "rows/sequences"
"""Sequences the update's gradient passes computed for its rows (fewer than rows where turns merged)."""
TOKENS_RECEIVED, TOKENS_COMPUTED = "rows/tokens_received", "rows/tokens_computed"
"""Prompt + completion tokens of the rows the gradient passes scored, and the tokens they ran through the model
(shared prefixes and merged turns computed once)."""
INFORMATIVE_GROUPS = "groups/informative"
"""Queries whose group had two or more distinct rewards."""
TOKENS_PER_S = "tokens_per_s"
TRAIN_S = "time/train_s"
"""Training time so far (rollouts + updates) on the run's budget clock."""
GRAD_NORM = "grad_norm/"
"""+ adapter name."""
TOPOLOGY = "topology/"
TOPOLOGY_LOSS = "topology/loss"
TOPOLOGY_ENTROPY = "topology/entropy"
TOPOLOGY_REWARD = "topology/reward"
"""Mean outcome reward of the episodes a topology update used."""
TOPOLOGY_KL_OLD = "topology/kl/old_k1"
"""HRPO's k1 estimate of KL(rollout policy || updated policy) over the decisions taken."""
TOPOLOGY_P = "topology/p/"
"""+ `<decision>/<option>`: an option's probability."""
TOPOLOGY_TYPE = "topology/type/"
"""+ `<query type>/<decision>/<option>`: the same per query type (a query-conditioned policy)."""

ALIASES = {"kl": KL_REF, "approx_kl": KL_OLD, "clip_frac": CLIP_FRAC, "rows": ROWS, "trajectories": TRAJECTORIES,
           "optimizer_steps": OPTIMIZER_STEPS, "informative_groups": INFORMATIVE_GROUPS,
           "topology/approx_kl": TOPOLOGY_KL_OLD}
"""Former name -> current name (runs written before the names were namespaced)."""


def canonical(record: Mapping[str, Any]) -> dict[str, Any]:
    """A metrics line under the current names (a former name's value moves to its current one unless that is
    also there)."""
    out = dict(record)
    for old, new in ALIASES.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    return out


class TopologyKey(NamedTuple):
    """A parsed `topology/p/...` or `topology/type/...` key."""

    kind: str | None
    """The query type (`topology/type/<type>/...`), None for the mean over queries."""
    decision: str
    option: str


def topology_key(key: str) -> TopologyKey | None:
    """`topology/p/<decision>/<option>` or `topology/type/<type>/<decision>/<option>` parsed (the option is the last
    segment, so a decision name may hold a `/`); None for any other key."""
    kind = None
    if key.startswith(TOPOLOGY_P):
        rest = key[len(TOPOLOGY_P):]
    elif key.startswith(TOPOLOGY_TYPE):
        kind, _, rest = key[len(TOPOLOGY_TYPE):].partition("/")
    else:
        return None
    decision, _, option = rest.rpartition("/")
    return TopologyKey(kind, decision, option) if decision and option else None


def topology_p(decision: str, option: str, kind: str | None = None) -> str:
    """The key of an option's probability (per query type with `kind`)."""
    return f"{TOPOLOGY_TYPE}{kind}/{decision}/{option}" if kind else f"{TOPOLOGY_P}{decision}/{option}"
