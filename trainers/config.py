"""The `train:` section of a graph, one model per algorithm keyed by `algorithm:` (torch-free, so a graph
validates without importing torch). `masgraph.trainers` registers them; the core spec keeps `train` opaque."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class FlowGRPOConfig(BaseModel):
    """Knobs of Flow-GRPO (defaults from the paper and its released config, LoRA learning rate ours)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    group_size: int = Field(8, ge=1)
    """G: rollouts per query."""
    clip_eps_low: float = Field(0.2, ge=0)
    """PPO clip below 1 (ratio floor 1 - eps_low)."""
    clip_eps_high: float = Field(0.3, ge=0)
    """PPO clip above 1 (clip-higher, as in AgentFlow's config)."""
    dual_clip: float | None = Field(None, gt=1)
    """c of dual-clip PPO: a negative-advantage token's loss is capped at -c A, so one whose probability ratio to
    the rollout's has grown past c pushes nothing (the PPO clip alone leaves -rho A unbounded for A < 0). Acts on
    off-policy mini-batches (`num_mini_batches` or `ppo_epochs` above 1). verl sets 3 (`clip_ratio_c`). None: off."""
    kl_coef: float = Field(0.001, ge=0)
    """beta: weight of the k3 KL to the reference policy."""
    lr: float = Field(5e-5, gt=0)
    """Adam learning rate of every adapter (LoRA wants far more than the paper's full-FT 1e-6)."""
    node_lr: dict[str, float] = Field(default_factory=dict)
    """Per-node learning rate overrides, by trainable node name (the nodes of a shared adapter need one value:
    override all of them or none)."""
    node_temperature: dict[str, float] = Field(default_factory=dict)
    """Per-node overrides of `temperature`, by trainable node name (the nodes of a shared policy need one value):
    e.g. more exploration for a node whose output is one of a few decisions (a memory manager's operation)."""
    loss_agg: Literal["token-mean", "nested"] = "token-mean"
    """token-mean: all tokens weigh the same (the released code); nested: trajectory -> turn -> token means (Eq. 10)."""
    group_by: Literal["query", "query_node"] = "query"
    """Advantage groups: the G trajectories of a query, or of a query per node."""
    zero_variance: Literal["skip", "keep", "resample"] = "skip"
    """Groups whose rewards are all equal: drop their rows; keep them (advantage 0; KL term only); or drop
    them and roll out fresh queries in their place (DAPO's dynamic sampling, up to `resample_rounds`)."""
    resample_rounds: int = Field(2, ge=0)
    """With `zero_variance: resample`: extra rollout rounds per step to replace zero-variance groups."""
    stragglers: Literal["drop", "zero"] = "drop"
    """Episodes that timed out, failed or were cancelled: leave them out of their group, or score them 0."""
    parse_penalty: float = Field(0.0, ge=0)
    """Subtracted from the outcome reward of an episode in which any step's output failed to parse (format
    shaping, like R1's format reward). 0 = outcome reward only, as in the paper."""
    advantage: Literal["episode", "step", "episode+step"] = "episode"
    """Credit: `episode` broadcasts the trajectory's group advantage to all its calls (the paper); `step` uses each
    step's advantage within its anchor-state group (steps of the group's trajectories in the same node with the
    same input: GiGPO, trainers/credit.py); `episode+step` adds the two, the step term weighted by `step_weight`."""
    step_weight: float = Field(1.0, ge=0)
    """w in A = A^E + w * A^S (`advantage: episode+step`; GiGPO's default 1)."""
    step_gamma: float = Field(1.0, gt=0, le=1)
    """Discount of a step's return: gamma^(steps after it) * the trajectory's reward (1: the outcome itself)."""
    branch_width: int = Field(0, ge=0)
    """Branching rollouts (ARPO, masgraph/branching.py): a query's `group_size` episodes are roots each followed by
    this many siblings that replay the root up to its least certain trainable step and sample from there (the
    group keeps its size); pair with `advantage: episode+step` so siblings compare where they split. 0: off."""
    format_weight: float = Field(0.0, ge=0)
    """Weight of each node's own format advantage, added to the outcome advantage of its calls: within a query's
    group, each call of a node scores -1 when its output failed to parse and 0 otherwise, normalised over that
    node's calls in the group (`credit.step_format_advantages`; a call fails by its own flag where its node sets
    one, as a memory manager does per fact, else by its step's). A node whose format can drift without changing the
    outcome (a verifier whose unparseable verdict falls back to `continue`, after which the loop bound still exits)
    is pushed back to its format, which the outcome alone never does, also in a group whose outcome has no signal.
    Unlike `parse_penalty`, the push lands on the node that broke its format only. 0: outcome only (the paper)."""
    entropy_bonus: float = Field(0.0, ge=0)
    """beta of an entropy bonus on every trainable call: each sampled token's advantage gains beta * its surprisal
    (-log pi_old of the token, at the temperature it was sampled), the REINFORCE estimate of the entropy's gradient
    (`pg_math.surprisal_bonus`), so a rarely sampled choice is pushed up and a certain token (surprisal ~0) is left
    alone. It needs no full-vocabulary pass, and it also acts on groups whose outcome has no signal (their rows are
    kept with outcome advantage 0, which makes a step's update dearer). It acts on every token of a completion:
    on the memory task (RESULTS.md, "Memory round 4") the entropy it bought went into the words after the manager's
    operation while the operation itself still collapsed to one choice. The advantage the TUI shows per call is the
    row's, before this per-token term. 0: off (the paper)."""
    counterfactual: dict[str, list[str]] = Field(default_factory=dict)
    """Counterfactual credit (masgraph/counterfactual.py), per trainable node whose calls choose among a closed set
    of completions: those completions, e.g. `{memory: ["Operation: ADD", "Operation: UPDATE", "Operation:
    DELETE", "Operation: NOOP"]}`. After each step's rollouts every call of such a node is re-scored with each
    alternative in its place (the rest of the record replayed, the later nodes run afresh), and the call's
    advantage gains `counterfactual_weight` * (its episode's reward - the mean of those scores), COMA's baseline:
    a decision is credited against the ones it did not take, also in a group whose episodes all scored alike.
    Costs one extra episode per call and alternative (each replays the record, so only the later nodes decode).
    Empty: off (the paper)."""
    counterfactual_weight: float = Field(1.0, ge=0)
    """w in A = A^E + ... + w * A^C for the calls of `counterfactual` nodes."""
    counterfactual_advantage: Literal["add", "replace"] = "add"
    """`add`: a scored call's w * A^C joins its outcome (and step) advantage. `replace`: it takes their place, as in
    COMA, where R - mean(Q) is the decision's whole advantage: the outcome advantage gives every decision of an
    episode the same push, so on a node making many decisions per episode it is mostly noise about any one of
    them (a call left unscored, e.g. in an episode that failed, keeps the outcome advantage; the format advantage
    stays)."""
    counterfactual_rows: bool = False
    """With `counterfactual`: also train on each alternative a call did not write and that scored above the mean of
    the call's scores, teacher-forced after the call's prompt (its tokens, then the call's own stop token), pushed
    up by `counterfactual_weight` * (its score - that mean); worse alternatives are not pushed down (an unsampled,
    unlikely completion pushed down has no bound: the KL ran away on the memory task, RESULTS.md round 5b). A
    choice the policy rarely samples but that would have scored higher is pushed up without waiting to be sampled
    (an all-action update, as mean actor-critic; not importance-weighted, so it moves the policy towards the better
    choices faster than the sampled-only gradient and is not unbiased for it).
    Needs a learner with a tokenizer (the HF learner). False: the sampled calls only."""
    counterfactual_norm: bool = False
    """With `counterfactual`: divide each node's counterfactual advantages, and its alternatives' rows, by their root
    mean square over the node's scored calls in the step (Dr.MAS's per-agent normalisation, arXiv 2602.08847, on
    the decision term; no re-centring: COMA's baseline already centres each decision, and a call whose alternatives
    scored alike stays 0). The term is then on the unit scale of the (normalised) outcome, step and format terms
    whatever one decision moves the score, and `counterfactual_weight` alone sets its share. Why: on the memory
    task a decision's raw term is ~0.17 and the format term carried 73-83 % of the first steps' updates
    (RESULTS.md, "where does the update's direction come from?"). False: raw score differences."""
    counterfactual_probes: bool = False
    """With `counterfactual`: score each decision on the task's probe questions too (`Task.probes`: further questions
    on the same input; `memory_updates` asks where each other person of the stream lives now), Q being the mean
    over the item's own question and its probes; the call's own Q is then that mean for the episode as made (its
    record replayed up to the decision's step), not the episode's reward. A decision that the item's question
    does not read (a memory manager's choice about another person) then still gets a signal. The decisions must
    not read the question (a memory manager sees the facts only: its recorded calls are replayed under another
    question). Costs one more episode per probe for each variant and each step as made (only the later nodes
    decode). False: the item's own question only. A task without probes scores as False."""
    counterfactual_decisions: int = Field(0, ge=0)
    """With `counterfactual`: score at most this many decisions of each episode, drawn uniformly per episode (seeded
    by the run's seed, the item and the sample, so a resumed run draws the same); the others get no counterfactual
    term, as an unscored call (with `counterfactual_advantage: replace` they keep the outcome advantage). Caps a
    step's scoring cost, one episode per decision and alternative (times 1 + probes), where episodes make many
    decisions. 0: every decision."""
    adv_eps: float = Field(1e-6, ge=0)
    """Added to the group's std."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of trainable policies during training rollouts (the update recomputes each
    row's logprobs at the temperature its call was recorded with)."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over a step's rollouts; above 1, later passes are off-policy and the PPO clip acts (verl)."""
    num_mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch: each epoch shuffles the rows (seeded) into this many mini-batches."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping per adapter."""
    micro_batch: int = Field(16, ge=1)
    """Rows per forward/backward pass (memory bound; a node's rows share their prompt prefix, computed once per
    pass)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Also cap a forward/backward pass at this many prompt + completion tokens (the GPU memory knob: activations
    and logits grow with tokens, not rows); None = rows only."""


class HRPOConfig(BaseModel):
    """Knobs of HRPO, the topology policy's trainer (reconstructed from MasHost; see trainers/hrpo.py)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
    baseline: Literal["group", "moving_average"] = "group"
    """`group`: HRPO's group-relative advantages (+ action-wise); `moving_average`: the GPTSwarm-style baseline
    (REINFORCE on whole-topology log-probs, moving-average baseline, no group normalisation, no action terms)."""
    momentum: float = Field(0.9, ge=0, lt=1)
    """Moving-average momentum (`baseline: moving_average`)."""
    no_signal: Literal["learn", "skip"] = "learn"
    """A group whose episodes all got the same *task* reward (every route failed, or every route worked): `learn`
    from it anyway (its token costs and action-wise terms then decide alone, pushing the cheapest route), or
    `skip` it, as Flow-GRPO skips zero-variance groups. In joint training, a route can fail only because its node
    has not learned yet; `skip` keeps the topology from forgetting that route before it has been tried with the
    current node policies (see trainers/joint.py)."""


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
    """Checkpoint every N steps (and at the end, and on Ctrl-C)."""
    seed: int = 0
    """Seeds the data order, sampling and LoRA initialisation."""
    deterministic: bool = False
    """Decode rollouts in the hf backend's deterministic mode: bit-exact runs and kill -9 resumes, at ~0.4x the
    rollout throughput of batched decoding (measured). Held-out evaluation is always deterministic."""
    concurrency: int = Field(16, ge=1)
    """Episodes in flight during rollouts and evaluation."""


class TrainSpec(TrainBase):
    """`algorithm: flow_grpo` — Flow-GRPO on the LoRA adapters of the graph's trainable policies."""

    algorithm: Literal["flow_grpo"] = "flow_grpo"
    """The RL algorithm."""
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
    flow_grpo: FlowGRPOConfig = Field(default_factory=FlowGRPOConfig)
    """Algorithm knobs."""

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


DEFAULT_ALGORITHM = "flow_grpo"


class HRPOTrainSpec(TrainSpec):
    """`algorithm: hrpo` — HRPO on the graph's topology policy (its `topology:` section); node policies frozen."""

    algorithm: Literal["hrpo"] = "hrpo"  # type: ignore[assignment]
    """The RL algorithm."""
    hrpo: HRPOConfig = Field(default_factory=HRPOConfig)
    """Topology trainer knobs (G = `hrpo.group_size` topologies per query)."""


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
    episode drew; measured better on both mixed tasks, benchmarks/RESULTS.md) or `sample` (each episode draws its
    route from it, the mix it chose)."""


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
    def _stages_need_the_staged_schedule(self) -> JointTrainSpec:
        # defaults are fine (a dumped spec has them), the old default too: specs dumped before node_topology's
        # default became `greedy` hold `sample`
        if self.schedule != "staged" and self.stages not in (StagesConfig(), StagesConfig(node_topology="sample")):
            raise ValueError(f"`stages` sets up `schedule: staged`, but the schedule is {self.schedule!r}; set "
                             "`schedule: staged`, or drop `stages`")
        return self
