"""What each view shows, as Rich text built from a RunIndex: pure functions, so tests read them without a screen."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.text import Text

from masgraph import metric_keys as mk
from masgraph.graph.space import node_places
from masgraph.trace import Step, Trace
from masgraph.watch.index import NodeStats, Row, RunIndex

STATUS_STYLE = {"ok": "green", "error": "bold red", "timeout": "red", "cancelled": "yellow"}


def human(n: float) -> str:
    """1234 -> 1.2k, 2500000 -> 2.5M."""
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.2f}"


def clock(seconds: float) -> str:
    """3725 -> 1:02:05 ('?' for a time that is not finite)."""
    if not math.isfinite(seconds):
        return "?"
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    return f"{h}:{rem // 60:02d}:{rem % 60:02d}" if h else f"{rem // 60}:{rem % 60:02d}"


# -- status line ----------------------------------------------------------------------------------------------

def status_line(index: RunIndex) -> Text:
    """Run name, kind, live or ended, episodes done and running, throughput over the last minute."""
    rows = index.rows
    text = Text()
    text.append(f" {index.path.name} ", style="bold")
    text.append("train " if index.is_training else "run ", style="cyan")
    if index.ended:
        text.append("ended ", style="green")
    else:
        text.append("● live ", style="bold yellow")
    text.append(f"{index.n_done:,} done")
    if index.live:
        text.append(f" · {len(index.live)} running")
    text.append(accuracy_text(index))
    rate = episode_rate(rows)
    if rate is not None:
        text.append(f" · {rate:.1f}/s")
    if not index.caught_up:
        text.append(" · reading the run's files…", style="yellow")
    return text


def accuracy_text(index: RunIndex) -> str:
    """' · 62% correct', and when episodes failed, the accuracy over the finished ones and the failures by kind
    (as `masgraph run` prints them), so a timeout is not read as a wrong answer."""
    if not index.n_scored:
        return f" · failed: cancelled {index.failures['cancelled']}" if index.failures else ""
    out = f" · {index.n_correct / index.n_scored:.0%} correct"
    if index.n_finished != index.n_scored and index.n_finished:
        out += f" ({index.n_correct / index.n_finished:.0%} of {index.n_finished:,} finished)"
    kinds = [f"{kind} {index.failures[kind]:,}" for kind in ("timeout", "error", "cancelled", "parse")
             if index.failures[kind]]
    return out + (f" · failed: {', '.join(kinds)}" if kinds else "")


def episode_rate(rows: Sequence[Row], window_s: float = 60.0) -> float | None:
    """Episodes per second over the `window_s` seconds up to the last episode that finished."""
    ended = [r.ended for r in rows[-2000:] if r.ended]
    if len(ended) < 2:
        return None
    end = max(ended)
    recent = [t for t in ended if t >= end - window_s]
    span = end - min(recent) if len(recent) >= 2 else 0.0
    return len(recent) / span if span > 0 else None


# -- graph view -----------------------------------------------------------------------------------------------

def graph_text(index: RunIndex) -> Text:
    """The graph in layers from the entry (loops' back edges cut), each node with its counts, edges with their
    traversals; the nodes running now lit; a topology-learning run's decision probabilities last."""
    stats = index.node_stats()
    edges = index.edge_counts()
    spec = index.spec
    out = Text()
    if spec is None:
        out.append("(no readable spec.yaml: nodes as the steps name them)\n\n", style="dim")
        layers = [sorted(stats)]
        spec_edges: list[Any] = []
    else:
        places = node_places(spec)
        layers = [[n for n in spec.nodes if places[n] == p] for p in sorted(set(places.values()))]
        layers += [[n for n in stats if n not in spec.nodes]] if any(n not in spec.nodes for n in stats) else []
        spec_edges = spec.edges
        out.append(f"{spec.name}", style="bold")
        out.append(f"  entry {spec.entry} → exit {spec.exit}\n", style="dim")
    for depth, layer in enumerate(layers):
        for node in layer:
            _node_block(out, depth, node, spec, stats.get(node, NodeStats()), spec_edges, edges)
    extra = [(e, n) for e, n in edges.items() if not any((x.source, x.target) == e for x in spec_edges)]
    if spec is not None and extra:
        out.append("\nother traversals: " + ", ".join(f"{a}→{b} ×{n:,}" for (a, b), n in extra) + "\n", style="dim")
    probs = index.decision_probs()
    if probs:
        step = next((r.get("step") for r in reversed(index.metrics) if any(map(mk.topology_key, r))), "?")
        out.append(f"\nTopology after step {step}", style="bold")
        out.append(" (metrics.jsonl: each option's probability, a query-conditioned policy's averaged over the "
                   "step's training queries; `masgraph topology RUN` shows the checkpoint per held-out query)\n",
                   style="dim")
        for decision, options in probs.items():
            out.append(f"  {decision}\n")
            for option, p in sorted(options.items(), key=lambda kv: -kv[1]):
                bar = "█" * round(p * 20)
                out.append(f"    {option:<14.14} {p:5.2f} ")
                out.append(f"{bar}\n", style="magenta")
    return out


def _node_block(out: Text, depth: int, node: str, spec: Any, s: NodeStats, spec_edges: Sequence[Any],
                edges: Counter[tuple[str, str]]) -> None:
    role = spec.nodes[node].role if spec is not None and node in spec.nodes else "?"
    lit = s.active > 0
    out.append(f"{depth:>2} ", style="dim")
    out.append(f" {node} ", style="bold black on yellow" if lit else "bold reverse")
    out.append(f" {role}", style="cyan")
    if lit:
        out.append(f"  ● {s.active} running", style="bold yellow")
    out.append("\n   ")
    out.append(f"calls {s.calls:,} · {s.mean_s:.2f} s · {human(s.tokens)} tok · ")
    out.append(f"{s.parse_failures:,} parse ✗", style="yellow" if s.parse_failures else "")
    out.append(" · ")
    out.append(f"{s.errors:,} err", style="bold red" if s.errors else "")
    out.append("\n")
    outs = [e for e in spec_edges if e.source == node]
    if outs:
        out.append("   ")
        for i, e in enumerate(outs):
            n = edges.get((e.source, e.target), 0)
            out.append("  " if i else "")
            out.append(f"→ {e.target}", style="" if n else "dim")
            if e.when:
                out.append(f" [{e.when}]", style="dim")
            out.append(f" ×{n:,}", style="green" if n else "dim")
        out.append("\n")


# -- episode detail -------------------------------------------------------------------------------------------

def episode_header(row: Row, trace: Trace | None) -> Text:
    text = Text()
    text.append(f"{row.id}\n", style="bold")
    if row.evaluation is not None:
        text.append(f"held-out evaluation at step {row.evaluation}\n", style="cyan")
    text.append("status ")
    text.append(row.status, style=STATUS_STYLE.get(row.status, ""))
    text.append(f" · reward {'-' if row.reward is None else f'{row.reward:.2f}'} · {row.turns} turns · "
                f"{row.tokens:,} tokens · {row.duration_s:.2f} s\n")
    text.append("query  ", style="dim")
    text.append(f"{trace.query if trace else row.query}\n")
    text.append("answer ", style="dim")
    text.append(f"{(trace.answer if trace else row.answer)!s}\n", style="bold")
    error = trace.error if trace else row.error
    if error:
        text.append(f"error  {error}\n", style="bold red")
    if trace is not None and trace.topology is not None:
        made = trace.topology.logprobs
        text.append("topology ", style="dim")
        text.append(", ".join(f"{d}={o}" for d, o in trace.topology.decisions.items() if d in made) or "(none)")
        text.append(f"  (v{trace.topology.version}, {trace.topology.mode})\n", style="dim")
    if trace is not None and trace.unused_steps:
        text.append(f"unused outputs: steps {trace.unused_steps}\n", style="yellow")
    return text


def step_text(step: Step, decode: Any = None, show_prompt: bool = False, logprob_colours: bool = False,
              credit: dict[tuple[int, int], float] | None = None,
              counterfactual: dict[tuple[int, int], list[tuple[str, float]]] | None = None,
              no_decode: str = "no tokenizer to show it") -> Text:
    """One step of the timeline: node, role, turn, route, timing; prompt (folded unless `show_prompt`), completion
    (coloured by per-token log-prob when `logprob_colours` and a tokenizer's `decode` is given) with the advantage a
    training update pushed it by (`credit`: (step index, call index) -> advantage) and, with counterfactual credit,
    the episode's score with each alternative in the call's place (`counterfactual`), memory operations, tool call,
    errors. `no_decode`: why a prompt asked for is not shown as text (no `decode`: still loading, or none here)."""
    text = Text()
    text.append(f"#{step.index} ", style="dim")
    text.append(step.node, style="bold")
    text.append(f" ({step.role}) turn {step.turn}", style="cyan")
    if step.sources:
        text.append(f" ← {', '.join(step.sources)}", style="dim")
    if step.route is not None:
        text.append(f" → route {step.route}", style="magenta")
    text.append(f" · {step.duration_s:.2f} s")
    if step.attempts > 1:
        text.append(f" · {step.attempts} attempts", style="yellow")
    if step.bounded:
        text.append(" · turn bound forced the exit", style="yellow")
    text.append("\n")
    for k, call in enumerate(step.llm):
        text.append("  prompt ", style="dim")
        if not call.prompt_ids:  # a text-only backend (litellm): no ids to show, only the server's counts
            text.append(f"{call.n_prompt} tokens (as the server counted; a text-only backend keeps no ids)\n",
                        style="dim")
        elif show_prompt and decode is not None:
            text.append(f"({call.n_prompt} tokens)\n", style="dim")
            text.append(_indent(decode(call.prompt_ids)) + "\n", style="grey62")
        else:
            note = "" if decode is not None or not show_prompt else f" ({no_decode})"
            text.append(f"▸ {call.n_prompt} tokens{note}, p to unfold\n" if not show_prompt else
                        f"{call.n_prompt} tokens{note}\n", style="dim")
        text.append("  output ", style="dim")
        mean = f"mean log-prob {sum(call.logprobs) / len(call.logprobs):.2f}, " if call.logprobs else ""
        text.append(f"({call.n_completion} tokens, {mean}"
                    f"{call.policy}{'/' + call.adapter if call.adapter else ''} v{call.policy_version})", style="dim")
        advantage = (credit or {}).get((step.index, k))
        if advantage is not None:
            text.append(f" advantage {advantage:+.2f}", style="green" if advantage > 0 else "red" if advantage < 0
                        else "dim")
        text.append("\n")
        alternatives = (counterfactual or {}).get((step.index, k))
        if alternatives:  # with probe questions the call's own score is recorded too: shown first, as made
            own = [score for a, score in alternatives if a.strip() == call.text.strip()]
            if own:
                text.append(f"  scored as made {own[0]:.2f}\n", style="dim")
            text.append("  scored instead ", style="dim")
            text.append(" · ".join(f"{_first_line(a)} {score:.2f}" for a, score in alternatives
                                   if a.strip() != call.text.strip()) + "\n", style="magenta")
        if logprob_colours and decode is not None and call.logprobs:
            text.append("  ")
            for token_id, lp in zip(call.completion_ids, call.logprobs, strict=False):
                text.append(decode([token_id]).replace("\n", "\n  "), style=_logprob_style(lp))
            text.append("\n")
        else:
            text.append(_indent(call.text) + "\n")
    if not step.llm and step.text:
        text.append("  output\n", style="dim")
        text.append(_indent(step.text) + "\n")
    if step.tool is not None:
        t = step.tool
        text.append(f"  tool   {t.tool}(", style="cyan")
        text.append(t.input[:500])
        text.append(f") {t.duration_s:.2f} s → ", style="cyan")
        text.append(t.output[:500] if t.output is not None else f"error: {t.error}",
                    style="" if t.error is None else "red")
        text.append("\n")
    if step.memory_ops:
        text.append(f"  memory {len(step.memory_ops)} operations\n", style="dim")
        for op in step.memory_ops:
            text.append(f"    {op.op:<6} ", style=_OP_STYLES[op.op])
            text.append(f"[{op.target}] " if op.target is not None else "    ", style="dim")
            text.append(op.fact[:200] + ("" if op.text in (None, op.fact) else f" → {op.text[:200]}"))
            text.append(f"  ({op.error})\n" if op.error else "\n", style="yellow")
    if step.parse_error:
        text.append(f"  parse  {step.parse_error}\n", style="yellow")
    if step.error:
        text.append(f"  error  {step.error}\n", style="bold red")
    text.rstrip()
    return text


_OP_STYLES = {"ADD": "green", "UPDATE": "cyan", "DELETE": "red", "NOOP": "dim"}


def _indent(s: str) -> str:
    return "  " + s.replace("\n", "\n  ")


def _first_line(s: str, limit: int = 40) -> str:
    """An alternative's label: its first line, cut to `limit` characters."""
    line = s.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _logprob_style(lp: float) -> str:
    """Green for a likely token, through yellow, to red for an unlikely one (p = exp(lp))."""
    p = math.exp(lp)
    return "green" if p >= 0.9 else "bright_green" if p >= 0.6 else "yellow" if p >= 0.3 else "red"


# -- training -------------------------------------------------------------------------------------------------

TRAIN_PLOTS = (mk.REWARD, mk.ACCURACY_TRAIN, mk.ACCURACY_TEST, mk.KL_REF, mk.LOSS_TOTAL, mk.CLIP_FRAC, mk.TOKENS_PER_S)
"""The standard series of the training view (`masgraph.metric_keys`; older runs' names are read as these)."""


def plot_keys(metrics: Sequence[dict[str, Any]]) -> list[str]:
    """The metric series the training view plots: the standard ones present, then per-adapter grad norms, the
    learning-health signals (groups without signal, per-node sampled entropy, reward per item type) and the
    topology policy's entropy and loss."""
    present: dict[str, None] = {}
    for rec in metrics:
        present.update(dict.fromkeys(k for k, v in rec.items() if isinstance(v, int | float)))
    keys = [k for k in TRAIN_PLOTS if k in present]
    keys += sorted(k for k in present if k.startswith(mk.GRAD_NORM))
    keys += [k for k in ("groups/no_signal",) if k in present]
    keys += sorted(k for k in present if k.startswith(("entropy/", "agree/", "parse/", "reward/type/")))
    keys += [k for k in (mk.TOPOLOGY_ENTROPY, mk.TOPOLOGY_LOSS) if k in present]
    return keys


def series(metrics: Sequence[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of one metric; a resumed run's repeated steps keep their last value."""
    by_step: dict[int, float] = {}
    for rec in metrics:
        value = rec.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            by_step[int(rec["step"])] = float(value)
    return sorted(by_step.items())


def progress(index: RunIndex) -> Text:
    """The training's step, the fraction done (of its steps, or of its minutes when that is further) and the ETA."""
    cfg = index.train_config or {}
    total, minutes = cfg.get("steps"), cfg.get("max_minutes")
    step = max((int(r["step"]) for r in index.metrics), default=0)
    step_times = [v for _, v in series(index.metrics, "time/step_s")]
    spent = sum(step_times)
    per_step = spent / len(step_times) if step_times else None
    fraction = None
    if isinstance(total, int) and total > 0:
        fraction = min(1.0, step / total)
    if isinstance(minutes, int | float) and minutes > 0 and per_step is not None:
        by_time = min(1.0, spent / (minutes * 60))
        fraction = by_time if fraction is None else max(fraction, by_time)
    text = Text()
    text.append(f"step {step}" + (f"/{total}" if total else ""), style="bold")
    if fraction is not None:
        text.append(f"  {'█' * round(fraction * 24)}{'░' * (24 - round(fraction * 24))} {fraction:.0%}")
    if index.ended:
        text.append("  ended", style="green")
    elif per_step is not None and fraction is not None and 0 < fraction < 1:
        text.append(f"  ETA {clock((1 - fraction) / fraction * spent)}", style="yellow")
    if per_step is not None:
        text.append(f"  {per_step:.1f} s/step", style="dim")
    return text


def checkpoints_text(index: RunIndex) -> Text:
    text = Text()
    text.append("checkpoints  ", style="bold")
    if not index.checkpoints:
        text.append("none yet", style="dim")
    for c in index.checkpoints[-6:]:
        versions = ",".join(f"{a} v{v}" for a, v in (c.get("versions") or {}).items())
        text.append(f"step-{c['step']}", style="green")
        text.append(f" ({versions})  " if versions else "  ", style="dim")
    return text


def node_table(index: RunIndex) -> Text:
    """Per node side by side: role, adapter, its last gradient norm, calls, tokens, parse failures, errors."""
    stats = index.node_stats()
    last = index.metrics[-1] if index.metrics else {}
    text = Text()
    text.append(f"{'node':<12}{'role':<10}{'adapter':<11}{'grad':>7}{'calls':>8}{'tokens':>8}{'parse✗':>8}"
                f"{'err':>6}\n", style="bold")
    spec = index.spec
    for node, s in stats.items():
        role = spec.nodes[node].role if spec and node in spec.nodes else "?"
        policy = spec.nodes[node].policy if spec and node in spec.nodes else None
        section = spec.policies.get(policy) if spec and policy else None
        adapter = str((section.get("adapter") if isinstance(section, dict) else None) or "-")
        grad = last.get(f"grad_norm/{adapter}")
        text.append(f"{node:<12.12}{role:<10.10}{adapter:<11.11}{'-' if grad is None else f'{grad:.3f}':>7}"
                    f"{s.calls:>8,}{human(s.tokens):>8}{s.parse_failures:>8,}{s.errors:>6,}\n")
    return text

