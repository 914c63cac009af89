"""The progress sinks of `masgraph run` (ProgressBar) and `masgraph train` (TrainProgress)."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

from masgraph.events import EpisodeFinished, Event, LLMCallFinished, TrainStep
from masgraph.metric_keys import (  # the metric keys TrainProgress reads (one table: masgraph/metric_keys.py)
    ACCURACY_TEST,
    ACCURACY_TRAIN,
    EPISODES_TEST,
    REWARD,
    ROWS,
    TOKENS_PER_S,
    TOPOLOGY_REWARD,
    TRAIN_S,
    topology_key,
)
from masgraph.metric_keys import KL_REF as KL
from masgraph.metric_keys import LOSS_TOTAL as LOSS
from masgraph.tasks import is_correct

TOPOLOGY_ONLY = frozenset({"hrpo", "reinforce"})
"""Algorithms that train the topology alone: their step line shows the topology reward and no node loss."""


class ProgressBar:
    """A sink that draws one status line: episodes done, accuracy, turns, tokens, rate."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 24):
        self.total, self.stream, self.width = total, stream, width
        self.done = self.correct = self.turns = self.tokens = self.failed = 0
        self.t0 = time.perf_counter()
        self.draw()

    def emit(self, event: Event) -> None:
        if isinstance(event, EpisodeFinished) and event.trace.status != "cancelled":  # only episodes that ran out
            tr = event.trace
            self.done += 1
            self.correct += is_correct(tr)
            self.turns += tr.turns
            self.tokens += tr.completion_tokens
            self.failed += tr.status != "ok"
            self.draw()

    def draw(self) -> None:
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * self.width) + "-" * (self.width - int(frac * self.width))
        n = max(self.done, 1)
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        line = (f"\r[{bar}] {self.done}/{self.total}  acc {self.correct / n:.2f}  turns {self.turns / n:.1f}  "
                f"tok {self.tokens / n:.0f}  failed {self.failed}  {rate:.2f} ep/s")
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


class TrainProgress:
    """Training progress on stderr (a sink of the loop's events): one line per training step, and, inside a step,
    what it does: rollouts and evaluations (episodes done of the total, tokens/s) and the update (time so far).

    `algorithm` is the run's (its resolved `train:` section's), which says what a step line shows. On a terminal
    the in-step status is one line redrawn in place (once a second and as episodes finish). Otherwise (a log file,
    a pipe) there are no carriage returns: a status line is printed when `every_s` seconds have passed since the
    last line, so a log gets one line per `every_s` during a long phase and none for a quick one."""

    def __init__(self, steps: int, out: TextIO | None = None, every_s: float = 30.0, tty: bool | None = None,
                 algorithm: str | None = None):
        self.steps, self._out, self.every_s, self._tty = steps, out, every_s, tty
        self.topology_only = algorithm in TOPOLOGY_ONLY
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._phase: tuple[str, int, int, float] | None = None  # name, step, total, start
        self.done = self.tokens = 0
        self._shown = False  # a terminal shows a status line the next print must clear
        self._last = time.perf_counter()  # when a line was last printed

    @property
    def out(self) -> TextIO:
        return self._out or sys.stderr

    @property
    def tty(self) -> bool:
        if self._tty is None:
            try:
                self._tty = self.out.isatty()
            except (AttributeError, ValueError):
                self._tty = False
        return self._tty

    def phase(self, name: str, step: int, total: int) -> None:
        """A phase of `step` starts (called by the training loop): 'rollouts', 'resampling', 'evaluation' (of
        `total` episodes) or 'update' (of `total` episodes)."""
        with self._lock:
            self._phase, self.done, self.tokens = (name, step, total, time.perf_counter()), 0, 0
            if self.tty:
                self._draw()
        if self._ticker is None:  # the update blocks the event loop: a thread keeps the status going
            self._ticker = threading.Thread(target=self._tick, name="masgraph-train-progress", daemon=True)
            self._ticker.start()

    def emit(self, event: Event) -> None:
        if isinstance(event, LLMCallFinished):
            with self._lock:
                self.tokens += event.completion_tokens
            return
        if isinstance(event, EpisodeFinished):
            with self._lock:
                self.done += 1
                if self.tty:
                    self._draw()
            return
        if not isinstance(event, TrainStep):
            return
        with self._lock:
            self._phase = None
            self._print(self._step_line(event))

    def close(self) -> None:
        """Stops the status line (clearing it on a terminal)."""
        self._stop.set()
        with self._lock:
            self._phase = None
            self._clear()
        if self._ticker is not None:
            self._ticker.join(timeout=2)

    def status(self) -> str:
        """The in-step status line ('' between phases)."""
        if self._phase is None:
            return ""
        name, step, total, t0 = self._phase
        elapsed = time.perf_counter() - t0
        clock = f"{int(elapsed // 60)}:{int(elapsed % 60):02d}"
        if name == "update":
            return f"step {step}/{self.steps}  update on {total} episodes  {clock}"
        return (f"step {step}/{self.steps}  {name} {self.done}/{total} episodes  "
                f"{self.tokens / max(elapsed, 1e-9):.1f} tok/s  {clock}")

    def _tick(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            with self._lock:
                if self._phase is None:
                    continue
                if self.tty:
                    self._draw()
                elif time.perf_counter() - self._last >= self.every_s:
                    self._print(self.status())

    def _draw(self) -> None:  # a terminal: the status line, redrawn in place
        self.out.write(f"\r{self.status()}\x1b[K")
        self.out.flush()
        self._shown = True

    def _clear(self) -> None:
        if self._shown:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._shown = False

    def _print(self, line: str) -> None:
        self._clear()
        print(line, file=self.out, flush=True)
        self._last = time.perf_counter()

    def _step_line(self, event: Any) -> str:
        m = event.metrics
        test = f"  acc(test) {m[ACCURACY_TEST]:.3f}" if ACCURACY_TEST in m else ""
        if test and EPISODES_TEST in m:  # how many held-out episodes that is
            test += f" of {m[EPISODES_TEST]:.0f}"
        if event.step == 0:
            return f"step 0/{self.steps}  (untrained){test}"
        reward = m.get(TOPOLOGY_REWARD if self.topology_only else REWARD, 0)
        rows = m.get(ROWS, 0)
        # a step whose every group scored alike has no advantage to push: say so rather than show a bare 0
        why = " (each group scored alike: no update)" if not rows else ""
        nodes = "" if self.topology_only else (
            f"kl {m.get(KL, 0):.4f}  loss {m.get(LOSS, 0):+.4f}  rows {rows:.0f}{why}  ")
        return (f"step {event.step}/{self.steps}  reward {reward:.3f}  acc(train) {m.get(ACCURACY_TRAIN, 0):.3f}"
                f"{test}  {nodes}{topology_summary(m)}{m[TOKENS_PER_S]:.1f} tok/s  {m[TRAIN_S] / 60:.1f} min")


def topology_summary(m: dict[str, Any]) -> str:
    """`topology <decision>=<most likely option> <p> ...` from a step's topology metrics ('' without them)."""
    best: dict[str, tuple[float, str]] = {}
    for key, p in m.items():
        parsed = topology_key(key)
        if parsed is not None and parsed.kind is None:
            best[parsed.decision] = max(best.get(parsed.decision, (-1.0, "")), (p, parsed.option))
    if not best:
        return ""
    return "topology " + " ".join(f"{d.split(':', 1)[-1]}={o} {p:.2f}" for d, (p, o) in best.items()) + "  "
