"""The `train:` section of a graph, one model per algorithm keyed by `algorithm:` (torch-free, so a graph
validates without importing torch). `masgraph.trainers` registers them; the core spec keeps `train` opaque."""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from masgraph.spec import MovedKeysWarning


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class CreditConfig(_Section):
    """Flow-GRPO's credit: which advantage each trainable call is pushed by."""

    advantage: Literal["episode", "step", "episode+step"] = "episode"
    """`episode` broadcasts the trajectory's group advantage to all its calls (the paper); `step` uses each step's
    advantage within its anchor-state group (steps of the group's trajectories in the same node with the same input:
    GiGPO, trainers/credit.py); `episode+step` adds the two, the step term weighted by `step_weight`."""
    group_by: Literal["query", "query_node"] = "query"
    """Advantage groups: the G trajectories of a query, or of a query per node."""
    step_weight: float = Field(1.0, ge=0)
    """w in A = A^E + w * A^S (`advantage: episode+step`; GiGPO's default 1)."""
    step_gamma: float = Field(1.0, gt=0, le=1)
    """Discount of a step's return: gamma^(steps after it) * the trajectory's reward (1: the outcome itself)."""
    format_weight: float = Field(0.0, ge=0)
    """Weight of each node's own format advantage, added to the outcome advantage of its calls: within a query's
    group, each call of a node scores -1 when its output failed to parse and 0 otherwise, normalised over that
    node's calls in the group (`credit.step_format_advantages`), so a node whose format can drift without changing
    the outcome is pushed back to it, and no other node is. 0: outcome only (the paper)."""
    parse_penalty: float = Field(0.0, ge=0)
    """Subtracted from the outcome reward of an episode in which any step's output failed to parse (format
    shaping, like R1's format reward). 0 = outcome reward only, as in the paper."""
    entropy_bonus: float = Field(0.0, ge=0)
    """beta of an entropy bonus on every trainable call: each sampled token's advantage gains beta * its surprisal
    (-log pi_old of the token, at its sampling temperature), the REINFORCE estimate of the entropy's gradient
    (`pg_math.surprisal_bonus`); it needs no full-vocabulary pass and acts on every token of a completion, also in
    groups whose outcome has no signal. The advantage the TUI shows per call is the row's, before this term.
    0: off (the paper)."""
    adv_eps: float = Field(1e-6, ge=0)
    """Added to the group's std."""


class PPOConfig(_Section):
    """Flow-GRPO's loss and optimizer steps (PPO-clip plus k3 KL to the reference, as in verl)."""

    clip_eps_low: float = Field(0.2, ge=0)
    """PPO clip below 1 (ratio floor 1 - eps_low)."""
    clip_eps_high: float = Field(0.3, ge=0)
    """PPO clip above 1 (clip-higher, as in AgentFlow's config)."""
    dual_clip: float | None = Field(None, gt=1)
    """c of dual-clip PPO: a negative-advantage token's loss is capped at -c A, so one whose probability ratio to
    the rollout's has grown past c pushes nothing. Acts on off-policy mini-batches (`num_mini_batches` or `epochs`
    above 1). verl sets 3 (`clip_ratio_c`). None: off."""
    kl_coef: float = Field(0.001, ge=0)
    """beta: weight of the k3 KL to the reference policy."""
    loss_agg: Literal["token-mean", "nested"] = "token-mean"
    """token-mean: all tokens weigh the same (the released code); nested: trajectory -> turn -> token means (Eq. 10)."""
    epochs: int = Field(1, ge=1)
    """Passes over a step's rollouts; above 1, later passes are off-policy and the PPO clip acts (verl)."""
    num_mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch: each epoch shuffles the rows (seeded) into this many mini-batches."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping per adapter."""


class BatchingConfig(_Section):
    """Which groups a step trains on, and how its rows are cut into forward passes."""

    zero_variance: Literal["skip", "keep", "resample"] = "skip"
    """Groups whose rewards are all equal: drop their rows; keep them (advantage 0; KL term only); or drop
    them and roll out fresh queries in their place (DAPO's dynamic sampling, up to `resample_rounds`)."""
    resample_rounds: int = Field(2, ge=0)
    """With `zero_variance: resample`: extra rollout rounds per step to replace zero-variance groups."""
    stragglers: Literal["drop", "zero"] = "drop"
    """Episodes that timed out, failed or were cancelled: leave them out of their group, or score them 0."""
    micro_batch: int = Field(16, ge=1)
    """Rows per forward/backward pass (memory bound; a node's rows share their prompt prefix, computed once per
    update phase on the hf learner, `masgraph/backends/hf/prefixes.py`)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Also cap a forward/backward pass at this many prompt + completion tokens (the GPU memory knob: activations
    and logits grow with tokens, not rows); None = rows only."""


class CounterfactualConfig(_Section):
    """Counterfactual credit (masgraph.learn.counterfactual): a decision credited against the ones it did not take."""

    alternatives: dict[str, list[str]] = Field(default_factory=dict)
    """Per trainable node whose calls choose among a closed set of completions: those completions, e.g. `{memory:
    ["Operation: ADD", "Operation: UPDATE", "Operation: DELETE", "Operation: NOOP"]}`. After each step's rollouts
    every call of such a node is re-scored with each alternative in its place (the rest of the record replayed, the
    later nodes run afresh), and the call's advantage gains `weight` * (its episode's reward - the mean of those
    scores), COMA's baseline. Costs one extra episode per call and alternative. Empty: off (the paper)."""
    weight: float = Field(1.0, ge=0)
    """w in A = A^E + ... + w * A^C for the calls of the `alternatives` nodes."""
    advantage: Literal["add", "replace"] = "add"
    """`add`: a scored call's w * A^C joins its outcome (and step) advantage. `replace`: it takes their place, as in
    COMA, where R - mean(Q) is the decision's whole advantage (a call left unscored keeps the outcome advantage;
    the format advantage stays)."""
    rows: bool = False
    """Also train on each alternative a call did not write and that scored above the mean of the call's scores,
    teacher-forced after the call's prompt, pushed up by `weight` * (its score - that mean); worse alternatives are
    not pushed down (an unsampled, unlikely completion pushed down has no bound). Not importance-weighted: faster
    towards the better choices, not unbiased. Needs a learner with a tokenizer (the HF learner). False: the sampled
    calls only."""
    norm: bool = False
    """Divide each node's counterfactual advantages, and its alternatives' rows, by their root mean square over the
    node's scored calls in the step (Dr.MAS's per-agent normalisation, arXiv 2602.08847, on this term alone), so
    `weight` alone sets the term's share whatever one decision moves the score. False: raw score differences."""
    probes: bool = False
    """Score each decision on the task's probe questions too (`Task.probes`), Q being the mean over the item's own
    question and its probes; the call's own Q is then that mean for the episode as made. The decisions must not
    read the question. Costs one more episode per probe for each variant and each step as made. A task without
    probes scores as False."""
    decisions: int = Field(0, ge=0)
    """Score at most this many decisions of each episode, drawn uniformly per episode (seeded by the run's seed,
    the item and the sample, so a resumed run draws the same); the others get no counterfactual term. Caps a step's
    scoring cost. 0: every decision."""


FLOW_GRPO_MOVES: dict[str, str] = {
    **{k: f"credit.{k}" for k in CreditConfig.model_fields},
    **{k: f"ppo.{k}" for k in PPOConfig.model_fields if k != "epochs"}, "ppo_epochs": "ppo.epochs",
    **{k: f"batching.{k}" for k in BatchingConfig.model_fields},
    **{f"counterfactual_{k}": f"counterfactual.{k}" for k in CounterfactualConfig.model_fields if k != "alternatives"},
}
"""Flat `flow_grpo:` keys of graph files written before the knobs were nested -> their new place."""


def migrate_flow_grpo(data: Any, prefix: str = "") -> tuple[Any, list[tuple[str, str]]]:
    """A `flow_grpo:` mapping with its old flat keys moved to their nested place (same values, same meaning), and
    the moves made (old path, new path, both under `prefix`). A key given both ways is left for validation to
    refuse; anything not a mapping is returned as it is."""
    if not isinstance(data, dict):
        return data, []
    out, moves = dict(data), []
    cf = out.get("counterfactual")
    if isinstance(cf, dict) and any(isinstance(v, list) for v in cf.values()):  # node -> alternatives: the old form
        out["counterfactual"] = {"alternatives": cf}
        moves.append((f"{prefix}counterfactual", f"{prefix}counterfactual.alternatives"))
    for old, new in FLOW_GRPO_MOVES.items():
        if old not in out:
            continue
        section, key = new.split(".")
        target = out.get(section, {})
        if not isinstance(target, dict) or key in target:
            raise ValueError(f"`{old}` moved to `{new}`, which is also given: keep `{new}` only")
        out[section] = {**target, key: out.pop(old)}
        moves.append((prefix + old, prefix + new))
    return out, moves


def warn_moved(moves: list[tuple[str, str]], dropped: str = "") -> None:
    """One `MovedKeysWarning` for `moves` (old path, new path; "" for a key dropped because nothing reads it)."""
    if moves:
        warnings.warn(MovedKeysWarning(moves, dropped), stacklevel=4)


def with_overrides(config: FlowGRPOConfig | dict[str, Any], overrides: dict[str, Any]) -> FlowGRPOConfig:
    """`config` (a model, or a `flow_grpo:` mapping such as an older run's config.json holds) with `overrides`
    applied key by key (`--set` knobs of the benchmarks), both in old flat keys or new ones, validated like YAML."""
    base = config.model_dump() if isinstance(config, BaseModel) else config
    (base, moved), (over, moved_too) = migrate_flow_grpo(base), migrate_flow_grpo(overrides)
    warn_moved(moved + moved_too)
    merged = {**base, **{k: {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict)
                         and k in SECTIONS else v for k, v in over.items()}}
    return FlowGRPOConfig.model_validate(merged)


SECTIONS = ("credit", "ppo", "batching", "counterfactual")


class FlowGRPOConfig(_Section):
    """Knobs of Flow-GRPO (defaults from the paper and its released config, LoRA learning rate ours), by concern."""

    group_size: int = Field(8, ge=1)
    """G: rollouts per query."""
    lr: float = Field(5e-5, gt=0)
    """Adam learning rate of every adapter (LoRA wants far more than the paper's full-FT 1e-6)."""
    node_lr: dict[str, float] = Field(default_factory=dict)
    """Per-node learning rate overrides, by trainable node name (the nodes of a shared adapter need one value:
    override all of them or none)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of trainable policies during training rollouts (the update recomputes each
    row's logprobs at the temperature its call was recorded with)."""
    node_temperature: dict[str, float] = Field(default_factory=dict)
    """Per-node overrides of `temperature`, by trainable node name (the nodes of a shared policy need one value):
    e.g. more exploration for a node whose output is one of a few decisions (a memory manager's operation)."""
    branch_width: int = Field(0, ge=0)
    """Branching rollouts (ARPO, masgraph.learn.branching): a query's `group_size` episodes are roots each followed
    by this many siblings that replay the root up to its least certain trainable step and sample from there (the
    group keeps its size); pair with `credit.advantage: episode+step` so siblings compare where they split. 0: off."""
    credit: CreditConfig = Field(default_factory=CreditConfig)
    """Which advantage each trainable call is pushed by."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    """The loss and its optimizer steps."""
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    """Which groups a step trains on, and the forward passes' size."""
    counterfactual: CounterfactualConfig = Field(default_factory=CounterfactualConfig)
    """Counterfactual credit (off unless `alternatives` are given)."""

    @model_validator(mode="before")
    @classmethod
    def _flat_keys_moved(cls, data: Any) -> Any:
        """Old flat keys (`clip_eps_low: 0.2`, `counterfactual: {memory: [...]}`) load in their new place, with a
        `MovedKeysWarning` naming it."""
        data, moves = migrate_flow_grpo(data)
        warn_moved(moves)
        return data

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> FlowGRPOConfig:
        """As pydantic's, but an update with old flat keys (which would set nothing the trainer reads) is applied in
        their new place, validated (`with_overrides`)."""
        if update and any(k not in type(self).model_fields for k in update):
            return with_overrides(self, update)
        return super().model_copy(update=update, deep=deep)


class HRPOConfig(_Section):
    """Knobs of HRPO, the topology policy's trainer (reconstructed from MasHost; see trainers/hrpo.py)."""

    group_size: int = Field(8, ge=2)
    """G: topologies sampled (and episodes run) per query (at least 2: advantages are relative to the group)."""
    lr: float = Field(0.1, gt=0)
    """Adam learning rate of the topology policy (its own optimizer; logits move fast, as in GPTSwarm)."""
    clip: float = Field(0.2, gt=0, lt=1)
    """PPO clip range of the decision probability ratios."""
    entropy_coef: float = Field(0.01, ge=0)
    """Entropy bonus per decision (keeps exploring until rewards say otherwise)."""
    omega: float = Field(0.5, ge=0)
    """Weight of the action-wise advantages: A = Â_group + ω·Ã_action."""
    cost_lambda: float = Field(0.0, ge=0)
    """Outcome reward = task reward − λ · completion tokens / 1000 (accuracy vs cost)."""
    token_cost: float = Field(1.0, ge=0)
    """Action-wise reward: − this · completion tokens / 1000 of the nodes a decision switched on."""
    parse_penalty: float = Field(1.0, ge=0)
    """Action-wise reward: − this per step of those nodes whose output failed to parse (component rationality)."""
    unused_penalty: float = Field(1.0, ge=0)
    """Action-wise reward: − this per step of those nodes whose output nothing used (`Trace.unused_steps`: no later
    step received it and no later prompt showed it; component rationality)."""
    ppo_epochs: int = Field(1, ge=1)
    """Optimizer steps per batch of rollouts (the clip acts from the second)."""
    no_signal: Literal["learn", "skip"] = "learn"
    """A group whose episodes all got the same *task* reward (every route failed, or every route worked): `learn`
    from it anyway (its token costs and action-wise terms then decide alone, pushing the cheapest route), or
    `skip` it, as Flow-GRPO skips zero-variance groups. In joint training, a route can fail only because its node
    has not learned yet; `skip` keeps the topology from forgetting that route before it has been tried with the
    current node policies (see trainers/joint.py)."""

    @model_validator(mode="before")
    @classmethod
    def _baseline_is_an_algorithm(cls, data: Any) -> Any:
        """`baseline: moving_average` was GPTSwarm's REINFORCE inside HRPO; it is its own algorithm now (a located
        error naming it, never a silent switch). `baseline: group` (HRPO itself) and the `momentum` it ignored are
        dropped with a warning."""
        if not isinstance(data, dict) or "baseline" not in data and "momentum" not in data:
            return data
        if data.get("baseline", "group") != "group":
            raise ValueError(f"`baseline: {data['baseline']}` was GPTSwarm's REINFORCE inside HRPO, now its own "
                             "algorithm: write `algorithm: reinforce` with its knobs under `reinforce:` (lr, "
                             "momentum, cost_lambda, group_size, no_signal, epochs), and drop `baseline`")
        data = dict(data)
        warn_moved([(f"hrpo.{k}", "") for k in ("baseline", "momentum") if data.pop(k, None) is not None],
                   "HRPO's group baseline is its only one")
        return data


class ReinforceConfig(_Section):
    """Knobs of GPTSwarm's topology trainer: REINFORCE on whole-topology log-probabilities against a moving-average
    baseline (no group normalisation, no action-wise terms); see trainers/reinforce.py."""

    group_size: int = Field(8, ge=1)
    """Topologies sampled (and episodes run) per query."""
    lr: float = Field(0.1, gt=0)
    """Adam learning rate of the topology policy."""
    momentum: float = Field(0.9, ge=0, lt=1)
    """Moving-average momentum of the baseline."""
    cost_lambda: float = Field(0.0, ge=0)
    """Reward = task reward − λ · completion tokens / 1000 (accuracy vs cost)."""
    epochs: int = Field(1, ge=1)
    """Optimizer steps per batch of rollouts."""
    no_signal: Literal["learn", "skip"] = "learn"
    """A group whose episodes all got the same task reward: `learn` from it anyway, or `skip` it."""


class TrainBase(BaseModel):
    """What every training algorithm shares: task, steps, budget, evaluation, checkpoints, seed."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    task: str | None = None
    """Default task (`--task` overrides)."""
    steps: int = Field(20, ge=1)
    """Optimizer steps."""
    queries_per_step: int = Field(4, ge=1)
    """Training queries per step (each rolled out `group_size` times)."""
    max_minutes: float | None = Field(None, gt=0)
    """Stop after this much training time (rollouts + updates; evaluation not counted), even before `steps`."""
    budget_clock: Literal["wall", "cpu"] = "wall"
    """What `max_minutes` counts: `wall` clock, or this process's `cpu` time (all its threads), so that a budget
    buys the same work on a busy, shared machine (benchmarks compare arms this way)."""
    eval_every: int = Field(5, ge=0)
    """Held-out evaluation (greedy, the graph's own sampling) at step 0 (untrained), every N steps and at the end;
    0 = only at the end."""
    eval_n: int = Field(32, ge=1)
    """Held-out items per evaluation."""
    checkpoint_every: int = Field(5, ge=1)
    """Keep every Nth step's checkpoint. Every finished step is checkpointed (a killed run resumes from its last
    finished step); the next one replaces it unless N keeps it, so a run holds steps N, 2N, ... and its newest."""
    seed: int = 0
    """Seeds the data order, sampling and LoRA initialisation."""
    deterministic: bool = False
    """Decode rollouts in the hf backend's deterministic mode: bit-exact runs and kill -9 resumes, at ~0.4x the
    rollout throughput of batched decoding (measured). Held-out evaluation is always deterministic."""
    concurrency: int = Field(16, ge=1)
    """Episodes in flight during rollouts and evaluation; the in-process hf backend batches up to as many rows (at
    least 32), so a step's rollouts decode together rather than in waves."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Experiment trackers that also get each step's metrics (every numeric key of metrics.jsonl, at its step) and
    this config as hyperparameters: offline, in the run dir (RUN/tensorboard, RUN/wandb, RUN/mlruns); a tracker that
    fails is a warning, never the run (docs/integrations.md)."""


class LoraTrainBase(TrainBase):
    """What an algorithm that trains LoRA adapters adds: their shape and the memory knob of its passes."""

    lora_rank: int = Field(16, ge=1)
    """LoRA rank of every trainable adapter."""
    lora_alpha: int = Field(32, ge=1)
    """LoRA alpha."""
    lora_targets: list[str] | Literal["all-linear"] = Field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names that get LoRA (a module whose name is, or ends in `.` + one of them), or `all-linear`: every
    linear layer but the output head (peft's shorthand; kept here as the list `[all-linear]`). A name the model
    lacks is an error that lists the ones it has, except on a fused layer: q_proj/k_proj/v_proj mean Phi3's
    `qkv_proj` (GPT-NeoX's `query_key_value`, GPT-2's `c_attn`, ...), gate_proj/up_proj Phi3's `gate_up_proj`."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less GPU memory for ~30 % more compute (the logprob pass
    then runs whole sequences instead of sharing the prompt prefix's KV)."""
    @field_validator("lora_targets", mode="before")
    @classmethod
    def _targets_as_list(cls, targets: object) -> object:
        """`all-linear` (any case) as `[all-linear]`: one type for every reader (the trainer takes
        `tuple(lora_targets)`); a list must name modules, or be `all-linear` alone."""
        if isinstance(targets, str):
            if targets.strip().lower() != "all-linear":
                raise ValueError(f"{targets[:60]!r} is one string: write a list of module names, e.g. "
                                 "[q_proj, v_proj], or all-linear")
            return ["all-linear"]
        if isinstance(targets, list):
            if not targets:
                raise ValueError("an empty list targets nothing: name modules, e.g. [q_proj, v_proj], or all-linear")
            if not all(isinstance(t, str) and t.strip() for t in targets):
                raise ValueError(f"{targets!r}: module names are strings, e.g. [q_proj, v_proj]")
            names = [t.strip().lower() for t in targets]
            if "all-linear" in names:
                if len(names) > 1:
                    raise ValueError("all-linear already targets every linear layer: write it alone, not in a list "
                                     "with module names")
                return ["all-linear"]
        return targets


class TrainSpec(LoraTrainBase):
    """`algorithm: flow_grpo` — Flow-GRPO on the LoRA adapters of the graph's trainable policies."""

    algorithm: Literal["flow_grpo"] = "flow_grpo"
    """The RL algorithm."""
    flow_grpo: FlowGRPOConfig = Field(default_factory=FlowGRPOConfig)
    """Algorithm knobs."""
    max_staleness: int = Field(0, ge=0, le=1)
    """Updates a step's rollouts may lag behind: 0 = on-policy (roll out, then update); 1 = the next step's rollouts
    decode while this step updates, on the adapters as they were before it (the clip's ratio is taken against the
    log-probs they recorded). The order of data stays fixed by step, so deterministic runs and resumes stay exact.
    In process the rollouts get their own copy of the base model (one replica serves one version at a time: hence
    at most 1)."""

    @model_validator(mode="before")
    @classmethod
    def _flat_flow_grpo_keys_moved(cls, data: Any) -> Any:
        """Old flat `flow_grpo:` keys load in their new place (warned here, where the section's path is known)."""
        if isinstance(data, dict) and isinstance(data.get("flow_grpo"), dict):
            try:
                flow_grpo, moves = migrate_flow_grpo(data["flow_grpo"], "flow_grpo.")
            except ValueError:  # a key given both ways: FlowGRPOConfig refuses it, located at `flow_grpo`
                return data
            warn_moved(moves)
            data = {**data, "flow_grpo": flow_grpo}
        return data


DEFAULT_ALGORITHM = "flow_grpo"


NOT_TOPOLOGY = ("lora_rank", "lora_alpha", "lora_targets", "gradient_checkpointing", "flow_grpo")
"""`train:` keys a topology-only algorithm never reads (specs dumped before they left its model hold them)."""


def _drop_node_keys(data: Any, algorithm: str) -> Any:
    if not isinstance(data, dict) or not any(k in data for k in NOT_TOPOLOGY):
        return data
    warn_moved([(k, "") for k in NOT_TOPOLOGY if k in data],
               f"`algorithm: {algorithm}` trains the topology only")
    return {k: v for k, v in data.items() if k not in NOT_TOPOLOGY}


class HRPOTrainSpec(TrainBase):
    """`algorithm: hrpo` — HRPO on the graph's topology policy (its `topology:` section); node policies frozen."""

    algorithm: Literal["hrpo"] = "hrpo"
    """The RL algorithm."""
    hrpo: HRPOConfig = Field(default_factory=HRPOConfig)
    """Topology trainer knobs (G = `hrpo.group_size` topologies per query)."""

    @model_validator(mode="before")
    @classmethod
    def _node_keys_dropped(cls, data: Any) -> Any:
        return _drop_node_keys(data, "hrpo")


class ReinforceTrainSpec(TrainBase):
    """`algorithm: reinforce` — GPTSwarm's REINFORCE on the graph's topology policy; node policies frozen."""

    algorithm: Literal["reinforce"] = "reinforce"
    """The RL algorithm."""
    reinforce: ReinforceConfig = Field(default_factory=ReinforceConfig)
    """Topology trainer knobs."""

    @model_validator(mode="before")
    @classmethod
    def _node_keys_dropped(cls, data: Any) -> Any:
        return _drop_node_keys(data, "reinforce")


class StagesConfig(BaseModel):
    """`schedule: staged` (see trainers/joint.py): the topology first on greedy-node rollouts, then the nodes with
    the topology held, then both."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    topology_steps: int = Field(10, ge=0)
    """Steps of HRPO alone, its rollouts decoding the nodes as the graph writes them (greedy by default), as
    topology-only training does: each route is judged by what its nodes do when deployed."""
    node_steps: int | None = Field(None, ge=0)
    """Then steps of Flow-GRPO alone (nodes sampled at `flow_grpo.temperature`, the topology held: not updated),
    so the nodes learn on the routes the topology chose; None: the rest of the run. Steps after both stages update
    both (`simultaneous`)."""
    node_topology: Literal["sample", "greedy"] = "greedy"
    """How the node stage rolls out the topology it holds: `greedy` (each query its most likely route, as deployed:
    a query's group then differs by its nodes' samples alone, so a node's advantage is not the luck of the route its
    episode drew) or `sample` (each episode draws its route from it, the mix it chose)."""


class JointTrainSpec(TrainSpec):
    """`algorithm: joint` — the same rollouts train the topology policy (HRPO) and every trainable node's LoRA
    (Flow-GRPO); G = `flow_grpo.group_size` episodes per query for both."""

    algorithm: Literal["joint"] = "joint"  # type: ignore[assignment]
    """The RL algorithm."""
    hrpo: HRPOConfig = Field(default_factory=HRPOConfig)
    """Topology trainer knobs (its `group_size` is not used: the groups are Flow-GRPO's)."""
    schedule: Literal["simultaneous", "alternate", "staged"] = "simultaneous"
    """`simultaneous`: both update after every step's rollouts; `alternate`: odd steps update the node policies,
    even steps the topology (each learns against the other held fixed); `staged`: the topology first, then the
    nodes, then both (`stages`; the reasoning is in trainers/joint.py)."""
    stages: StagesConfig = Field(default_factory=StagesConfig)
    """Stage lengths (and the node stage's topology mode) of `schedule: staged`."""

    @model_validator(mode="after")
    def _topology_rollouts_are_on_policy(self) -> JointTrainSpec:
        if self.max_staleness:
            raise ValueError("`max_staleness` overlaps rollouts with the update, but joint training's rollouts sample "
                             "topologies from the policy that update changes; drop `max_staleness` (or train the "
                             "nodes alone with `algorithm: flow_grpo`)")
        return self

    @model_validator(mode="after")
    def _stages_need_the_staged_schedule(self) -> JointTrainSpec:
        # defaults are fine (a dumped spec has them), the old default too: specs dumped before node_topology's
        # default became `greedy` hold `sample`
        if self.schedule != "staged" and self.stages not in (StagesConfig(), StagesConfig(node_topology="sample")):
            raise ValueError(f"`stages` sets up `schedule: staged`, but the schedule is {self.schedule!r}; set "
                             "`schedule: staged`, or drop `stages`")
        return self
