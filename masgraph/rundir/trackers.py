"""Experiment trackers (TensorBoard, W&B, MLflow) as one more sink on the training metrics: each metrics.jsonl line
at its step, the resolved config as hyperparameters, and at the end the learning-curve and topology pictures;
offline by default, everything in the run dir.

Each tracker's library is imported only when `train.report_to` names it. A tracker that cannot start or stops
working (not installed, a server down) is one `warning:` line on stderr and is dropped; training goes on and
metrics.jsonl stays the record.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from masgraph.events import Event, TrainStep
from masgraph.rundir.layout import METRICS

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The names `train.report_to` / `--report-to` take."""


class Tracker(Protocol):
    """One experiment tracker's run: metrics by step, closed once at the end."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def image(self, name: str, png: Path, step: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics line (what a tracker can chart); bools, strings and None are left out."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A nested config as `a.b.c -> value` (lists and None as JSON text): the form hyperparameter tables take."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= flat_config(value, name + ".")
        elif isinstance(value, str | int | float | bool):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out


class TensorBoardTracker:
    """Event files under RUN/tensorboard (`tensorboard --logdir RUN/tensorboard`), written by torch's SummaryWriter
    (which needs the `tensorboard` package); the config as the hparams plugin's session."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        for summary in hparams(flat_config(config), {}):
            self.writer.file_writer.add_summary(summary)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a live `tensorboard` sees each step as it ends

    def image(self, name: str, png: Path, step: int) -> None:
        from matplotlib.image import imread

        self.writer.add_image(name, imread(png)[..., :3], step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, `mode=offline` unless WANDB_MODE says otherwise, under RUN/wandb (`wandb sync RUN/wandb/offline-run-*`
    uploads it); project from WANDB_PROJECT (default `masgraph`)."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        import wandb

        self.run = wandb.init(mode=os.environ.get("WANDB_MODE", "offline"), dir=str(run_dir),
                              project=os.environ.get("WANDB_PROJECT", "masgraph"), name=run_dir.name,
                              config=dict(config), reinit="create_new", settings=wandb.Settings(silent=True))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def image(self, name: str, png: Path, step: int) -> None:
        import wandb

        self.run.log({name: wandb.Image(str(png))}, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^\w\-./ :]")  # MLflow's key alphabet
_MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""Defaults for a remote MLflow (each left as set when it is): MLflow's own (7 retries, factor 2, 120 s) hold a
training step for minutes when the server is down."""


class MlflowTracker:
    """An MLflow run in a file store under RUN/mlruns (`mlflow ui --backend-store-uri RUN/mlruns`), or in the
    store MLFLOW_TRACKING_URI names (a server, a database); experiment from MLFLOW_EXPERIMENT_NAME (default
    `masgraph`). Needs only `mlflow-skinny`."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the run dir's own file store: MLflow 3 keeps it (in maintenance) behind this opt-in
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for var, value in _MLFLOW_HTTP.items():  # a server that is down costs seconds, not minutes of retries
            os.environ.setdefault(var, value)
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "masgraph")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
        params = [Param(_MLFLOW_BAD.sub("_", k), str(v)[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        rows = [Metric(_MLFLOW_BAD.sub("_", k), v, now, step) for k, v in metrics.items() if math.isfinite(v)]
        for i in range(0, len(rows), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=rows[i:i + 1000])

    def image(self, name: str, png: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(png), artifact_path="plots")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_KINDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


def _warn(name: str, what: str, exc: BaseException) -> None:
    reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    print(f"warning: report_to {name}: {what} ({reason}); training goes on, metrics.jsonl stays the record",
          file=sys.stderr, flush=True)


class TrackerSink:
    """Sends each `TrainStep`'s numeric metrics to the trackers named in `report_to` (a sink beside metrics.jsonl).

    Example:
        >>> sink = TrackerSink(["tensorboard"], run_dir, {"train": cfg.model_dump()})
        >>> sink.emit(TrainStep(step=1, metrics={"reward/mean": 0.5}))
        >>> sink.close()
    """

    def __init__(self, report_to: Iterable[str], run_dir: Path, config: Mapping[str, Any]):
        self.run_dir, self.step = Path(run_dir), None
        self.trackers: dict[str, Tracker] = {}
        for name in dict.fromkeys(report_to):
            try:
                if name not in _KINDS:
                    raise ValueError(f"unknown tracker; use one of {', '.join(TRACKERS)}")
                self.trackers[name] = _KINDS[name](Path(run_dir), config)
            except Exception as exc:  # not installed, a server down, a bad setting: the run still trains
                _warn(name, "could not start", exc)

    def emit(self, event: Event) -> None:
        if not isinstance(event, TrainStep) or not self.trackers:
            return
        metrics, self.step = scalars(event.metrics), event.step
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(event.step, metrics)
            except Exception as exc:
                _warn(name, "stopped logging", exc)
                del self.trackers[name]

    def close(self) -> None:
        """The learning-curve and topology pictures (`masgraph plot`'s, from RUN/metrics.jsonl) at the last step,
        then each tracker's run closed."""
        if self.trackers and self.step is not None:
            self._plots(self.step)
        for name, tracker in self.trackers.items():
            try:
                tracker.close()
            except Exception as exc:
                _warn(name, "could not close", exc)
        self.trackers = {}

    def _plots(self, step: int) -> None:
        from masgraph.rundir.plot import plot_run, plot_topology

        if not (self.run_dir / METRICS).is_file():  # a sink used without the loop's metrics.jsonl
            return
        with tempfile.TemporaryDirectory() as tmp:
            try:
                plots = {"learning_curve": plot_run(self.run_dir, Path(tmp) / "learning_curve.png"),
                         "topology_curve": plot_topology(self.run_dir, Path(tmp) / "topology_curve.png")}
            except Exception as exc:  # matplotlib missing, an unreadable metrics.jsonl
                _warn(", ".join(self.trackers), "could not draw the plots", exc)
                return
            for name, tracker in list(self.trackers.items()):
                try:
                    for key, png in plots.items():
                        if png is not None:
                            tracker.image(key, png, step)
                except Exception as exc:
                    _warn(name, "could not log the plots", exc)
