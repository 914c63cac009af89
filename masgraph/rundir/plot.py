"""Learning-curve picture of a training run: reward and held-out accuracy per step (metrics.jsonl -> PNG)."""

from __future__ import annotations

from pathlib import Path

from masgraph.metric_keys import ACCURACY_TEST, REWARD, canonical, topology_key
from masgraph.rundir.layout import METRICS
from masgraph.rundir.store import read_jsonl


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write `learning_curve.png` (or `out`) for a run directory; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    run_dir = Path(run_dir)
    rows = [canonical(r) for r in read_jsonl(run_dir / METRICS)]  # a cut last line (killed run) left out
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    train = [r for r in rows if REWARD in r]
    steps, rewards = [r["step"] for r in train], [r[REWARD] for r in train]
    ax.plot(steps, rewards, label="train reward (mean per step)", color="tab:blue", alpha=0.35)
    if len(rewards) >= 5:  # per-step rewards of a few queries are noisy: show a 5-step moving average too
        avg = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
        ax.plot(steps, avg, label="train reward (5-step average)", color="tab:blue")
    evals = [r for r in rows if ACCURACY_TEST in r]
    ax.plot([r["step"] for r in evals], [r[ACCURACY_TEST] for r in evals], "o-", label="held-out accuracy (greedy)",
            color="tab:red")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    out = Path(out) if out else run_dir / "learning_curve.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_topology(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """Write `topology_curve.png` (or `out`): each topology decision's option probabilities per step (the
    `topology/p/<decision>/<option>` metrics of a topology-training run); None when the run has none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = [r for r in read_jsonl(run_dir / METRICS) if isinstance(r.get("step"), int)]
    keys = {k: parsed for r in rows for k in r if (parsed := topology_key(k)) is not None and parsed.kind is None}
    if not keys:
        return None
    decisions = sorted({p.decision for p in keys.values()})
    fig, axes = plt.subplots(len(decisions), 1, figsize=(7, 2.2 * len(decisions)), dpi=120, squeeze=False)
    for ax, d in zip(axes[:, 0], decisions):
        for k in sorted(k for k, p in keys.items() if p.decision == d):
            pts = [(r["step"], r[k]) for r in rows if k in r]
            ax.plot([s for s, _ in pts], [p for _, p in pts], label=keys[k].option)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(d, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=7)
    axes[-1, 0].set_xlabel("step")
    out = Path(out) if out else run_dir / "topology_curve.png"
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out
