"""Flow-GRPO (AgentFlow, "In-the-Flow Agentic System Optimization", Eq. 10) for any set of trainable nodes.

One outcome reward per trajectory is broadcast to every turn of every trainable node; advantages are
normalised over the G trajectories of a group (each trajectory counted once, not once per turn-row);
every trainable LLM call is one training row, using the token ids and logprobs recorded at generation;
the loss is PPO-clip with asymmetric clipping plus k3 KL to the reference (the base model with the
adapter disabled). Each trainable node's policy has its own LoRA adapter on the shared base. As in verl,
`ppo_epochs` passes go over a step's rows, shuffled into `num_mini_batches` mini-batches, one optimizer
step each; the old logprobs are the recorded ones, so from the second optimizer step on the clip acts.

Sampling parameters: every row's logprobs are recomputed at the temperature its call was recorded with
(a greedy call's logprobs are the raw logits', i.e. temperature 1). top_p is not part of the probability:
the backend records the temperature-scaled softmax before nucleus truncation, and the update recomputes
that same distribution, as verl does for its old and new logprobs. Truncation then only decides which
tokens get sampled; ratios start at exactly 1 and the policy's full distribution is what is trained.

The math is pure functions below, tested against hand-computed values; `FlowGRPO.update` applies them.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from masgraph import metric_keys as keys
from masgraph.device import is_out_of_memory
from masgraph.errors import MasgraphError, Problem, SpecError
from masgraph.events import Sink
from masgraph.learn import data_parallel
from masgraph.learn.data_parallel import token_shards
from masgraph.learn.learner import Learner
from masgraph.learn.rollouts import RolloutShape, run_rollouts
from masgraph.learn.sharding import clip_grad_norm, full_state, full_tensor, is_sharded, shard_state
from masgraph.runtime.cancel import raise_if_cancelled
from masgraph.runtime.runner import Runner
from masgraph.spec import GraphSpec
from masgraph.tasks import Item, Task
from masgraph.threads import working
from masgraph.trace import LLMCall, Trace
from masgraph.trainers.algorithm import TrainAlgorithm, TrainContext
from masgraph.trainers.checks import node_knob_problems, owner_values
from masgraph.trainers.config import FlowGRPOConfig
from masgraph.trainers.credit import (
    counterfactual_advantages,
    counterfactual_scales,
    counterfactual_values,
    format_advantages,
    recorded_scores,
    step_advantages,
    step_format_advantages,
)
from masgraph.trainers.pg_math import group_advantages, kl_k3, ppo_clip_loss, surprisal_bonus

__all__ = ["FlowGRPO", "FlowGRPOConfig", "Row", "aggregate", "build_rows", "format_advantages", "group_advantages",
           "informative_queries", "step_format_advantages",
           "kl_k3", "logprob_temperature", "micro_batches", "mini_batches", "ppo_clip_loss", "row_weights",
           "alternative_rows", "sampling_spec", "surprisal_bonus", "trajectory_rewards"]


@dataclass
class Row:
    """One trainable LLM call: what the model saw and produced, and the advantage it is pushed by."""

    traj: int
    """Index of its trajectory in the batch."""
    node: str
    adapter: str
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    policy_version: int
    temperature: float = 1.0
    """Softmax temperature `old_logprobs` are under (the logprobs are recomputed at it)."""
    step: int = 0
    call: int = 0
    """Where the call is in its trajectory: its step's index and its index among the step's calls."""
    alternative: str | None = None
    """With `counterfactual.rows`: the alternative this row teacher-forces in the call's place (None: the call's own
    completion); its `old_logprobs` are computed by the update."""


# ---- pure math ---------------------------------------------------------------------------------------

def row_weights(lengths: list[int], trajs: list[int], mode: str) -> list[float]:
    """Weight of each row's summed token loss in the scalar loss (so a loss summed chunk by chunk is exact).

    token-mean: 1 / (all tokens). nested (Eq. 10, mean over trajectories of the mean over the trajectory's
    rows of the mean over the row's tokens): 1 / (trajectories × rows in the row's trajectory × its tokens)."""
    if mode == "token-mean":
        return [1.0 / sum(lengths)] * len(lengths)
    if mode == "nested":
        rows_in = Counter(trajs)
        return [1.0 / (len(rows_in) * rows_in[t] * n) for n, t in zip(lengths, trajs)]
    raise MasgraphError(f"unknown loss aggregation {mode!r}; use 'token-mean' or 'nested'")


def aggregate(token_losses: list[torch.Tensor], trajs: list[int], mode: str) -> torch.Tensor:
    """Reduce per-row token losses to one scalar (`row_weights` says how)."""
    weights = row_weights([t.numel() for t in token_losses], trajs, mode)
    return torch.stack([w * t.sum() for w, t in zip(weights, token_losses)]).sum()


def mini_batches(n: int, k: int, rng: random.Random) -> list[list[int]]:
    """Row indices 0..n-1 shuffled by `rng` and cut into at most `k` near-equal non-empty mini-batches, each
    sorted (so a node's rows stay together in a forward pass)."""
    order = list(range(n))
    rng.shuffle(order)
    cuts = [order[i * n // k:(i + 1) * n // k] for i in range(k)]
    return [sorted(c) for c in cuts if c]


def micro_batches(lengths: list[int], max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Positions 0..n-1 cut, in order, into forward passes of at most `max_rows` rows and (when given) at most
    `max_tokens` prompt + completion tokens; a row longer than the budget goes alone."""
    out: list[list[int]] = []
    tokens = 0
    for i, n in enumerate(lengths):
        if out and len(out[-1]) < max_rows and (max_tokens is None or tokens + n <= max_tokens):
            out[-1].append(i)
            tokens += n
        else:
            out.append([i])
            tokens = n
    return out


def logprob_temperature(call: LLMCall, config: FlowGRPOConfig) -> float:
    """The softmax temperature a call's recorded logprobs are under: its sampling temperature, or 1 (the raw
    logits) for a greedy call. Traces recorded before calls carried a temperature assume `config.temperature`."""
    t = getattr(call, "temperature", None)
    if t is None:
        t = config.temperature
    return t if t > 0 else 1.0


def trajectory_rewards(traces: list[Trace], config: FlowGRPOConfig) -> dict[int, float]:
    """Reward per trajectory index; stragglers (failed, timed out, cancelled) are left out or scored 0;
    `parse_penalty` is taken off an episode in which any step failed to parse."""
    rewards: dict[int, float] = {}
    for i, tr in enumerate(traces):
        if tr.status == "ok" and tr.reward is not None:
            rewards[i] = tr.reward - config.credit.parse_penalty * any(s.parse_error for s in tr.steps)
        elif config.batching.stragglers == "zero":
            rewards[i] = 0.0
    return rewards


def informative_queries(traces: list[Trace], config: FlowGRPOConfig) -> set[str]:
    """Queries whose group has at least two distinct rewards (the groups that give a non-zero advantage)."""
    by_query: dict[str, set[float]] = defaultdict(set)
    for i, r in trajectory_rewards(traces, config).items():
        by_query[traces[i].item_id].add(r)
    return {q for q, rs in by_query.items() if len(rs) > 1}


def build_rows(traces: list[Trace], trainable: dict[str, str], config: FlowGRPOConfig,
               encode: Callable[[str], list[int]] | None = None) -> list[Row]:
    """Training rows from a batch of trajectories. `trainable` maps node name -> adapter name.

    The trajectory's reward is broadcast to every trainable call in it; the advantage comes from the
    trajectory's group (by query, or by query and node), where each trajectory counts once. With `advantage:
    step | episode+step` a call's anchor-state advantage (trainers/credit.py) replaces or joins it, and with
    `format_weight` the node's own format advantage joins it, and with `counterfactual` a decision's counterfactual
    advantage (its reward against the alternatives it did not take; with `counterfactual.advantage: replace` in
    place of the outcome and step terms); a row is kept when any term can push it (with
    `entropy_bonus`, every row: the bonus is per token, added in the update)."""
    rewards = trajectory_rewards(traces, config)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i in rewards:
        nodes = {s.node for s in traces[i].steps if s.node in trainable and s.llm}
        keys = [(traces[i].item_id,)] if config.credit.group_by == "query" else [(traces[i].item_id, n) for n in nodes]
        for key in keys:
            groups[key].append(i)
    adv: dict[tuple[int, tuple], float] = {}
    for key, members in groups.items():
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64, device="cpu")  # host scalars
        if config.batching.zero_variance != "keep" and (len(members) < 2 or bool((r == r[0]).all())):
            continue
        for i, a in zip(members, group_advantages(r, config.credit.adv_eps).tolist()):
            adv[(i, key)] = a
    credit = config.credit
    fmt = step_format_advantages(traces, groups, trainable, credit.adv_eps) if credit.format_weight else {}
    episode = config.credit.advantage != "step"
    step_adv = (step_advantages(traces, rewards, groups, trainable, config.credit.step_gamma, config.credit.adv_eps)
                if config.credit.advantage != "episode" else {})
    w = 1.0 if config.credit.advantage == "step" else config.credit.step_weight
    alternatives = config.counterfactual.alternatives
    cf = counterfactual_advantages(traces, alternatives) if alternatives else {}
    scales = counterfactual_scales(traces, cf) if config.counterfactual.norm else {}
    rows = []
    for i in rewards:
        tr = traces[i]
        for step in tr.steps:
            if step.node not in trainable:
                continue
            key = (tr.item_id,) if config.credit.group_by == "query" else (tr.item_id, step.node)
            outcome = adv.get((i, key)) if episode else None
            for k, call in enumerate(step.llm):
                at = (i, step.index, k)
                alone = config.counterfactual.advantage == "replace" and at in cf
                extra = (config.credit.format_weight * fmt.get(at, 0.0) + (0.0 if alone else w * step_adv.get(at, 0.0))
                         + config.counterfactual.weight * scales.get(step.node, 1.0) * cf.get(at, 0.0))
                base = None if alone else outcome
                if call.completion_ids and (base is not None or extra != 0.0 or config.credit.entropy_bonus > 0):
                    rows.append(Row(i, step.node, trainable[step.node], call.prompt_ids, call.completion_ids,
                                    call.logprobs, (base or 0.0) + extra, call.policy_version,
                                    logprob_temperature(call, config), step.index, k))
    if config.counterfactual.rows and encode is not None:
        rows += alternative_rows(traces, trainable, config, encode, scales)
    return rows


def alternative_rows(traces: list[Trace], trainable: dict[str, str], config: FlowGRPOConfig,
                     encode: Callable[[str], list[int]], scales: dict[str, float] | None = None) -> list[Row]:
    """With `counterfactual.rows`: a row per alternative a `counterfactual` call did not write and that scored above
    the mean of the call's scores, its tokens (`encode`, then the call's stop token) after the call's prompt, its
    advantage `counterfactual_weight` * (its score - that mean), times the node's `scales` entry (with
    `counterfactual.norm`: the one its calls' counterfactual advantages get). Worse alternatives get no row:
    pushing down a completion the policy did not sample, often already unlikely, has no bound (log p -> -inf, and
    the KL to the reference with it), and raising the better ones lowers the rest
    through the softmax. `old_logprobs` empty: the update computes them under the adapters the rollouts used."""
    rows = []
    for i, tr in enumerate(traces):
        values = counterfactual_values(tr, config.counterfactual.alternatives)
        for step in tr.steps:
            for k, call in enumerate(step.llm):
                if (step.index, k) not in values or step.node not in trainable or not call.prompt_ids:
                    continue
                q = values[(step.index, k)]
                stop = call.completion_ids[-1:] if call.finish_reason == "stop" else []
                for alt, v in zip(config.counterfactual.alternatives[step.node], q):
                    adv = config.counterfactual.weight * (scales or {}).get(step.node, 1.0) * (v - sum(q) / len(q))
                    if alt.strip() != call.text.strip() and adv > 0.0:
                        rows.append(Row(i, step.node, trainable[step.node], call.prompt_ids, encode(alt) + stop, [],
                                        adv, call.policy_version, logprob_temperature(call, config), step.index, k,
                                        alternative=alt))
    return rows


def _alternatives_scored(trace: Trace) -> int:
    """How many alternatives `trace`'s calls were scored with (with probe questions the calls' own scores, also
    recorded, are not alternatives)."""
    own = {(s.index, k): call.text.strip() for s in trace.steps for k, call in enumerate(s.llm)}
    return sum(len(texts) - (own.get(ref) in texts) for ref, texts in recorded_scores(trace).items())


# ---- the update --------------------------------------------------------------------------------------

class FlowGRPO(TrainAlgorithm):
    """Applies Flow-GRPO updates to a learner's LoRA adapters, one Adam optimizer per adapter; each updated adapter
    becomes a new version (`learner.new_version`), which the training loop then publishes to the rollout backends.

    Example:
        >>> algo = FlowGRPO(learner, {"planner": "planner", "verifier": "verifier"}, FlowGRPOConfig())
        >>> metrics = algo.update(traces)          # traces: G rollouts per query from the Runner
    """

    state_file = "optimizer.pt"

    def __init__(self, learner: Learner, trainable: dict[str, str], config: FlowGRPOConfig, seed: int = 0,
                 queries_per_step: int = 1):
        self.learner, self.trainable, self.config = learner, trainable, config
        self._credit: dict[str, list[tuple[int, int, float]]] = {}
        self.seed, self.queries_per_step, self.group_size = seed, queries_per_step, config.group_size
        cf = config.counterfactual
        self.shape = RolloutShape(config.branch_width, cf.alternatives, cf.probes, cf.decisions)
        """How its rollouts are shaped (branching, counterfactual scoring: `masgraph.learn.rollouts`)."""
        self._encode: Callable[[str], list[int]] | None = None
        problems = node_knob_problems(config, trainable)
        if problems:
            raise SpecError(problems)
        if config.counterfactual.rows:
            tokenizer = getattr(getattr(learner, "weights", None), "tokenizer", None)
            if tokenizer is None:
                raise SpecError([Problem("train.flow_grpo.counterfactual.rows", "needs a learner with a tokenizer "
                                         "(the HF learner) to force the alternatives' tokens")])
            self._encode = partial(tokenizer.encode, add_special_tokens=False)
        self.max_extra_rounds = config.batching.resample_rounds if config.batching.zero_variance == "resample" else 0
        lrs = per_owner("node_lr", config.node_lr, config.lr, trainable, "adapter", "learning rates")
        missing = sorted(a for a in lrs if a not in learner.adapters())
        if missing:
            raise MasgraphError(f"adapters {missing} are not on the learner; add each with "
                                f"`learner.add_adapter(name, LoraConfigSpec(...))` before building the trainer")
        self.params = {a: learner.parameters(a) for a in lrs}
        for a, ps in self.params.items():
            if not ps:
                raise MasgraphError(f"adapter {a!r} has no LoRA parameters on the learner's model; add it with "
                                    f"`learner.add_adapter({a!r}, LoraConfigSpec(...))` before building the trainer")
        self.optimizers = {a: torch.optim.Adam(self.params[a], lr=lrs[a]) for a in lrs}
        self.dp = data_parallel.current()
        """The learner ranks this process shares each update with (`masgraph.learn.data_parallel`); None alone."""
        self.lockstep = self.dp is not None and bool(getattr(learner, "sharded", False))
        """The base is sharded across the ranks (`masgraph.learn.sharding`): each forward pass all-gathers every layer,
        so every rank runs the same number of passes per adapter, in the same order (`_schedule`)."""
        if self.dp and not self.lockstep:  # every rank starts from rank 0's adapters (sharding broadcast them)
            self.dp.broadcast_parameters([p for a in sorted(self.params) for p in self.params[a]])
        self._whole_state = self._gather_state()
        """In `lockstep`: each adapter's optimizer state with whole tensors as of the last update (every rank gathers
        it then; rank 0 alone checkpoints)."""

    # ---- as the loop drives it (TrainAlgorithm) --------------------------------------------------------
    @classmethod
    def build(cls, ctx: TrainContext) -> FlowGRPO:
        return cls(ctx.learner, ctx.trainable, ctx.config.flow_grpo, seed=ctx.config.seed,
                   queries_per_step=ctx.config.queries_per_step)

    def rollout_spec(self, spec: GraphSpec) -> GraphSpec:
        """Trainable policies sample at `flow_grpo.temperature` (or their nodes' `node_temperature`); the rest as
        written."""
        per_policy = per_owner("node_temperature", self.config.node_temperature, self.config.temperature,
                               {n: spec.nodes[n].policy for n in self.trainable}, "policy", "temperatures")
        return sampling_spec(spec, self.config.temperature, per_policy)

    async def rollouts(self, runner: Runner, task: Task, items: list[Item], sinks: Sequence[Sink]) -> list[Trace]:
        """The runner's items × samples, branched and counterfactually scored as `shape` says."""
        return (await run_rollouts(runner, task, items, self.shape, sinks)).traces

    def extra_queries(self, traces: list[Trace], rounds: int) -> int:
        """With `zero_variance: resample` (DAPO's dynamic sampling): the queries short of `queries_per_step`
        informative groups, for up to `resample_rounds` extra rounds."""
        if rounds >= self.max_extra_rounds:
            return 0
        return max(0, self.queries_per_step - len(informative_queries(traces, self.config)))

    def train_step(self, traces: list[Trace], step: int) -> dict[str, float]:
        metrics = self.update(traces, seed=f"{self.seed}:{step}") | {
            keys.INFORMATIVE_GROUPS: float(len(informative_queries(traces, self.config)))}
        if self.config.counterfactual.alternatives:  # how many decisions were scored, and how many of them mattered
            cf = counterfactual_advantages(traces, self.config.counterfactual.alternatives)
            metrics |= {"counterfactual/variants": float(sum(_alternatives_scored(t) for t in traces)),
                        "counterfactual/calls": float(len(cf)),
                        "counterfactual/mattered": sum(a != 0 for a in cf.values()) / max(1, len(cf))}
        return metrics

    def credit(self) -> dict[str, list[tuple[int, int, float]]]:
        return self._credit

    def state_dict(self) -> dict[str, Any]:
        """Each adapter's Adam moments (whole tensors, also when the base is sharded)."""
        return self._whole_state if self.lockstep else {a: opt.state_dict() for a, opt in self.optimizers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for a, opt in self.optimizers.items():
            opt.load_state_dict(state[a])
            if self.lockstep:  # each rank keeps its shard of the moments
                shard_state(opt)
        self._whole_state = state if self.lockstep else None  # whole already: no collective while ranks load

    def _gather_state(self) -> dict[str, Any] | None:
        """In `lockstep` (every rank, a collective): each adapter's optimizer state with whole tensors."""
        return {a: full_state(opt.state_dict()) for a, opt in self.optimizers.items()} if self.lockstep else None

    # ---- the update -------------------------------------------------------------------------------------
    def update(self, traces: list[Trace], seed: int | str = 0) -> dict[str, float]:
        """`ppo_epochs` passes over the rows of `traces`, each shuffled (seeded by `seed`) into `num_mini_batches`
        mini-batches with one optimizer step per adapter each; returns metrics (loss, kl, clip fraction, ...)."""
        with working():  # rollouts decoding beside it share the cores (masgraph/threads.py)
            if self.lockstep:  # FSDP's own collectives too: a lost rank is PeerLost's one error line
                with self.dp.guard("sharded update"):
                    return self._update(traces, seed)
            return self._update(traces, seed)

    def _update(self, traces: list[Trace], seed: int | str) -> dict[str, float]:
        cfg = self.config
        if self.dp:  # every rank trains on rank 0's rollouts, whatever its own gave
            traces = self.dp.broadcast(traces)
        rows = build_rows(traces, self.trainable, cfg, self._encode)
        credit: dict[str, list[tuple[int, int, float]]] = defaultdict(list)  # what `credit` reports
        for r in rows:
            if r.alternative is None:  # the calls as made (an alternative's score is in the Credited event)
                credit[traces[r.traj].episode_id].append((r.step, r.call, r.advantage))
        self._credit = dict(credit)
        metrics = {keys.ROWS: float(len(rows)), keys.REWARD: _mean([t.reward or 0.0 for t in traces])}
        if not rows:
            return metrics | {keys.LOSS_TOTAL: 0.0}
        rng = random.Random(seed)
        epochs = [mini_batches(len(rows), cfg.ppo.num_mini_batches, rng) for _ in range(cfg.ppo.epochs)]
        # each rank's rows over the update (a row of several mini-batches once): the frozen passes compute these
        shares = [sorted({b[k] for batch in epochs for b in batch for k in self._shares([rows[i] for i in b])[r]})
                  for r in range(self.dp.world if self.dp else 1)]
        totals: dict[str, Any] = defaultdict(float)
        norms: dict[str, list[Any]] = defaultdict(list)
        losses = []
        try:
            self._alternatives_old_logprobs(rows, shares)
            ref = self._reference_logprobs(rows, shares)
            for batch in (b for epoch in epochs for b in epoch):
                losses.append(self._optimizer_step([rows[i] for i in batch], [ref[i] for i in batch], totals, norms))
        except BaseException as exc:  # also a cancellation (Ctrl-C) between two passes
            for adapter in norms:  # weights an optimizer already stepped are a new version, whatever comes next
                self.learner.new_version(adapter)
            if is_out_of_memory(exc):
                raise _out_of_memory(exc, cfg, rows) from exc
            raise
        for adapter in norms:
            self.learner.new_version(adapter)
        if self.lockstep:  # the adapters' and their optimizers' whole tensors, for checkpoints and publishing
            self.learner.gather()  # (every rank: collectives)
            self._whole_state = self._gather_state()
        totals = {k: float(totals[k]) for k in ("pg", "kl", "clip", "approx_kl")}  # host syncs, after the last step
        losses = [float(x) for x in losses]
        if self.dp:  # each rank summed its share of rows: the step's totals are the sums over ranks
            sums = self.dp.all_reduce_sum(torch.tensor([*totals.values(), *losses], dtype=torch.float64))
            totals, losses = dict(zip(totals, sums[:len(totals)].tolist())), sums[len(totals):].tolist()
        grad_norms = {a: [float(full_tensor(x)) for x in xs] for a, xs in norms.items()}
        n_tok = cfg.ppo.epochs * sum(len(r.completion_ids) for r in rows)  # tokens scored over all epochs
        return metrics | {f"{keys.GRAD_NORM}{a}": _mean(g) for a, g in grad_norms.items()} | {
            keys.LOSS_TOTAL: _mean(losses), keys.LOSS_POLICY: totals["pg"] / n_tok, keys.KL_REF: totals["kl"] / n_tok,
            keys.CLIP_FRAC: totals["clip"] / n_tok, keys.KL_OLD: totals["approx_kl"] / n_tok + 0.0,
            keys.OPTIMIZER_STEPS: float(len(losses)), keys.TRAJECTORIES: float(len({r.traj for r in rows}))
        } | _pack_metrics(self.learner, self.dp)

    def _shares(self, rows: list[Row]) -> list[list[int]]:
        """Each rank's positions of `rows` (a mini-batch), split by tokens (`token_shards`); all of them alone."""
        if self.dp is None:
            return [list(range(len(rows)))]
        return token_shards([len(r.prompt_ids) + len(r.completion_ids) for r in rows], self.dp.world)

    def _rank(self) -> int:
        return self.dp.rank if self.dp else 0

    def _alternatives_old_logprobs(self, rows: list[Row], shares: list[list[int]] | None = None) -> None:
        """Fill the `old_logprobs` of alternative rows (never sampled; of this rank's share, default all) under the
        adapters as the rollouts used them (the update has not stepped yet), so their PPO ratio starts at 1."""
        shares = [[i for i in share if rows[i].alternative is not None] for share in shares or [range(len(rows))]]
        for i, lp in self._frozen_logprobs(rows, shares, reference=False).items():
            rows[i].old_logprobs = lp.float().tolist()

    def _reference_logprobs(self, rows: list[Row], shares: list[list[int]] | None = None) -> list[torch.Tensor | None]:
        """Each row's logprobs under the base model (adapters off), for this rank's share (default all; None
        elsewhere); fixed for the whole update."""
        out = self._frozen_logprobs(rows, shares or [list(range(len(rows)))], reference=True)
        return [out.get(i) for i in range(len(rows))]

    def _frozen_logprobs(self, rows: list[Row], shares: list[list[int]], reference: bool) -> dict[int, torch.Tensor]:
        """Position -> logprobs of `rows[position]` for this rank's share (of every rank's `shares`) with no graph
        kept (only the values are needed), under the base model (`reference`: adapters off) or the row's adapter;
        rows of one adapter share forward passes."""
        out: dict[int, torch.Tensor] = {}
        with self._shared_prefixes():
            for adapter, chunk, real in self._schedule(rows, shares):
                raise_if_cancelled()  # Ctrl-C / SIGTERM: the update stops here, uncommitted (trainers/loop.py)
                with torch.no_grad():
                    lps = self.learner.sequence_logprobs([rows[i] for i in chunk], None if reference else adapter)
                if real:
                    out.update(zip(chunk, lps))
        return out

    def _shared_prefixes(self) -> AbstractContextManager[Any]:
        """The learner's scope in which one phase's passes compute each adapter's prompt prefix once
        (`HFLearner.shared_prefixes`); nothing for a learner without one."""
        scope = getattr(self.learner, "shared_prefixes", None)
        return scope() if scope is not None else nullcontext()

    def _schedule(self, rows: list[Row], shares: list[list[int]]) -> list[tuple[str, list[int], bool]]:
        """This rank's forward passes over its share of `rows` as (adapter, positions, real), adapter by adapter in
        name order, each adapter's rows cut by `_passes`. In `lockstep` every rank runs as many passes per adapter
        as the rank with the most, over the adapters of every share: the extra ones (`real` False) go over one row
        of that adapter and are discarded (they all-gather the layers as the others' passes do)."""
        mine = shares[self._rank()]
        named = shares if self.lockstep else [mine]
        out = []
        for adapter in sorted({rows[i].adapter for share in named for i in share}):
            of = [[i for i in share if rows[i].adapter == adapter] for share in named]
            passes = [self._passes([rows[i] for i in own], own) for own in of]
            here = passes[self._rank() if self.lockstep else 0]
            out += [(adapter, chunk, True) for chunk in here]
            if self.lockstep:
                filler = next(i for own in of for i in own)
                out += [(adapter, [filler], False)] * (max(map(len, passes)) - len(here))
        return out

    def _optimizer_step(self, rows: list[Row], ref: list[torch.Tensor], totals: dict[str, float],
                        grad_norms: dict[str, list[float]]) -> float:
        """One optimizer step per adapter on a mini-batch (its loss aggregated over the mini-batch alone);
        accumulates token statistics into `totals` and returns the mini-batch's loss. With data parallelism this rank
        computes its share of the rows under the whole mini-batch's weights, and the gradients are summed over ranks
        before the step, so every rank steps as one process would (and returns its share of the loss)."""
        cfg = self.config
        weights = row_weights([len(r.completion_ids) for r in rows], [r.traj for r in rows], cfg.ppo.loss_agg)
        adapters = sorted({r.adapter for r in rows})
        for a in adapters:
            self.optimizers[a].zero_grad(set_to_none=True)
        total: torch.Tensor | float = 0.0  # on the model's device: one host sync per update, not per pass
        self.learner.train()
        try:
            with self._shared_prefixes():  # its exit sends the prefixes' gradient back through them: before the step
                for adapter, chunk, real in self._schedule(rows, self._shares(rows)):
                    raise_if_cancelled()
                    new = self.learner.sequence_logprobs([rows[k] for k in chunk], adapter)
                    if not real:  # a lockstep pass: no gradient of its own, but the layers' reduce-scatter as others'
                        (0.0 * new[0].sum()).backward()
                        continue
                    loss = sum(weights[k] * self._token_loss(rows[k], lp, ref[k], totals).sum()
                               for k, lp in zip(chunk, new))
                    loss.backward()  # weighted so the chunks' losses sum to the configured aggregate
                    total = total + loss.detach().double()
        finally:
            self.learner.train(False)
        if self.dp:  # every adapter of the mini-batch, in order, zeros where this rank had none of its rows; a sharded
            # layer's gradients left their backward passes summed (`shard_layers`): only LoRA outside the layers here
            self.dp.all_reduce_grads([[p for p in self.params[a] if not (self.lockstep and is_sharded(p))]
                                      for a in adapters])
        for a in adapters:
            grad_norms[a].append(clip_grad_norm(self.params[a], cfg.ppo.max_grad_norm))
            self.optimizers[a].step()
        return total

    def _passes(self, rows: list[Row], positions: list[int]) -> list[list[int]]:
        """`positions` (of `rows`, in order) cut into forward passes by `micro_batch` and `micro_batch_tokens`."""
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rows]
        batching = self.config.batching
        return [[positions[j] for j in chunk]
                for chunk in micro_batches(lengths, batching.micro_batch, batching.micro_batch_tokens)]

    def _token_loss(self, row: Row, logp: torch.Tensor, ref: torch.Tensor, totals: dict[str, float]) -> torch.Tensor:
        """Per-token PPO-clip + beta * k3 KL of one row (its advantage plus, with `entropy_bonus`, each token's
        surprisal bonus); adds its clip count, KLs and policy loss to `totals`."""
        cfg = self.config
        old = torch.tensor(row.old_logprobs, device=logp.device)
        adv = torch.tensor(row.advantage, device=logp.device)
        if cfg.credit.entropy_bonus:
            adv = adv + surprisal_bonus(old, cfg.credit.entropy_bonus)
        pg = ppo_clip_loss(logp, old, adv, cfg.ppo.clip_eps_low, cfg.ppo.clip_eps_high, cfg.ppo.dual_clip)
        kl = kl_k3(logp, ref)
        log_ratio = logp.detach() - old
        ratio = torch.exp(log_ratio)
        # device tensors until the update ends: no host sync per row
        # (each row's sum in its own dtype, the running totals in float64, as Python floats summed them before)
        totals["clip"] += ((ratio < 1 - cfg.ppo.clip_eps_low) | (ratio > 1 + cfg.ppo.clip_eps_high)).sum()
        # k3 of KL(old || new), as CleanRL logs it: >= 0, so expm1 (exp(x) - 1 rounds to 0 for a tiny x, leaving -x)
        # and each token's rounding clamped at 0 (a run on-policy logged approx_kl -0.0 and tiny negatives)
        totals["approx_kl"] += (torch.expm1(log_ratio) - log_ratio).clamp_min(0).sum().double()
        totals["kl"] += kl.detach().sum().double()
        totals["pg"] += pg.detach().sum().double()
        return pg + cfg.ppo.kl_coef * kl


def per_owner(knob: str, overrides: dict[str, float], default: float, owner_of: dict[str, str], owner: str,
              what: str) -> dict[str, float]:
    """`checks.owner_values`, raising its problems (a Python-built graph reaches the trainer unvalidated)."""
    values, problems = owner_values(knob, overrides, default, owner_of, owner, what)
    if problems:
        raise SpecError(problems)
    return values


def sampling_spec(spec: GraphSpec, temperature: float, per_policy: dict[str, float] | None = None) -> GraphSpec:
    """The graph with its trainable policies sampling at `temperature`, or at `per_policy[name]` (what Flow-GRPO
    explores with)."""
    per_policy = per_policy or {}
    hot = {n: p.model_copy(update={"sampling": p.sampling.model_copy(
        update={"temperature": per_policy.get(n, temperature)})}) if p.trainable else p
        for n, p in spec.policies.items()}
    return spec.model_copy(update={"policies": hot})


def _out_of_memory(exc: BaseException, cfg: FlowGRPOConfig, rows: list[Row]) -> MasgraphError:
    """The update ran out of device memory: say which knobs shrink a forward pass (nothing is checkpointed
    from the half-done update; the run's last checkpoint stays as it was)."""
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    budget = cfg.batching.micro_batch_tokens or cfg.batching.micro_batch * longest
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return MasgraphError(
        f"out of device memory in the Flow-GRPO update ({type(exc).__name__}; {len(rows)} rows, longest "
        f"{longest} tokens, micro_batch {cfg.batching.micro_batch}); fix: set "
        f"`train.flow_grpo.batching.micro_batch_tokens` below {budget} (tokens per forward pass) or lower "
        "`batching.micro_batch`, and/or `train.gradient_checkpointing: true`; then resume (--resume RUN): the last "
        "checkpoint is intact")


def _pack_metrics(learner: Learner, dp: data_parallel.DataParallel | None = None) -> dict[str, float]:
    """Sequences and tokens the update's gradient passes computed, from a learner that packs (`pack_stats`), summed
    over the learner ranks (each computed its share)."""
    if not hasattr(learner, "pack_stats"):
        return {}
    stats = learner.pack_stats()
    names = {"sequences": keys.SEQUENCES, "tokens_received": keys.TOKENS_RECEIVED,
             "tokens_computed": keys.TOKENS_COMPUTED}
    values = [float(stats.get(k, 0)) for k in names]
    if dp:
        values = dp.all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()
    return dict(zip(names.values(), values))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan
