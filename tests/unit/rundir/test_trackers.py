"""train.report_to: a recorded run's real metrics.jsonl lines fed to each tracker, read back with its own library."""

from __future__ import annotations

import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

from masgraph.events import EvalFinished, TrainStep
from masgraph.rundir.trackers import TrackerSink, flat_config, scalars

RECORDED = Path(__file__).resolve().parents[2] / "data" / "recorded" / "router-train"


def recorded() -> tuple[list[dict], dict]:
    rows = [json.loads(line) for line in (RECORDED / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((RECORDED / "config.json").read_text())["config"]  # {"train": ..., "task": ...}


def feed(names: list[str], run_dir: Path) -> dict[int, dict[str, float]]:
    """Every recorded line to a sink (as the loop sends it); the numeric metrics expected per step."""
    rows, config = recorded()
    shutil.copy(RECORDED / "metrics.jsonl", run_dir / "metrics.jsonl")  # as the loop writes it (the plots' source)
    sink = TrackerSink(names, run_dir, config)
    assert list(sink.trackers) == names
    for row in rows:
        sink.emit(TrainStep(step=row["step"], metrics={k: v for k, v in row.items() if k != "step"}))
        sink.emit(EvalFinished(step=row["step"], metrics={"accuracy/test": -1.0}))  # not a metrics.jsonl line
    sink.close()
    expected = {row["step"]: scalars({k: v for k, v in row.items() if k != "step"}) for row in rows}
    assert {"grad_norm/planner", "topology/p/choice:planner/calc"} <= expected[1].keys()  # per node, topology
    return expected


def test_tensorboard_event_files_hold_every_metric_at_every_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    expected = feed(["tensorboard"], tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            got.setdefault(event.step, {})[tag] = event.value
    assert got.keys() == expected.keys()
    for step, metrics in expected.items():
        assert got[step] == pytest.approx(metrics, rel=1e-6), step
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the config, for the HPARAMS tab
    assert {i.step for tag in ("learning_curve", "topology_curve") for i in acc.Images(tag)} == {max(expected)}


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (.wandb: a LevelDB-style log of `Record` protos in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, buf = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a record still being written
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or a fragmented one's last piece
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
            buf = b""
    return out


@pytest.mark.slow  # importing wandb takes seconds
def test_wandb_offline_run_dir_holds_every_metric_and_the_config(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default
    expected = feed(["wandb"], tmp_path)
    (log,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while not (records := wandb_records(log)) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, "the run's log has no exit record"
        time.sleep(0.2)  # finish() returns while the wandb-core service still writes the log's tail
    history: dict[int, dict] = {}  # step -> its values (the last step's plots come as a row of their own)
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(r.history.step.num, {}).update({k: v for k, v in items.items() if k[0] != "_"})
    last = history[max(expected)]
    images = {k.split("/")[0]: last.pop(k) for k in list(last) if k.endswith("_curve/_type")}  # (nested keys)
    assert images == {"learning_curve": "image-file", "topology_curve": "image-file"}
    for k in [k for k in last if k.startswith(("learning_curve/", "topology_curve/"))]:
        del last[k]
    assert history.keys() == expected.keys()
    for step, metrics in expected.items():
        assert history[step] == pytest.approx(metrics), step
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["train"] == recorded()[1]["train"]
    media = {"_".join(p.name.split("_")[:2]) for p in log.parent.glob("files/media/images/*.png")}
    assert media == {"learning_curve", "topology_curve"}  # the pictures themselves


@pytest.mark.slow  # importing mlflow takes seconds
def test_mlflow_file_store_holds_every_metric_and_the_config(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    expected = feed(["mlflow"], tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("masgraph").experiment_id])
    assert run.info.status == "FINISHED"
    got: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            got.setdefault(m.step, {})[key] = m.value
    assert got == {step: pytest.approx(metrics) for step, metrics in expected.items()}
    config = recorded()[1]
    assert run.data.params == {k: str(v) for k, v in flat_config(config).items()}
    assert run.data.params["train.flow_grpo.clip_eps_low"] == str(config["train"]["flow_grpo"]["clip_eps_low"])
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/learning_curve.png", "plots/topology_curve.png"}


def test_a_tracker_that_cannot_start_is_one_warning_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails as if not installed
    sink = TrackerSink(["wandb", "tensorboard"], tmp_path, {"train": {}})
    sink.emit(TrainStep(step=1, metrics={"reward/mean": 0.5}))
    sink.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: report_to wandb: could not start (ModuleNotFoundError")
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow  # importing mlflow takes seconds
def test_an_mlflow_server_that_is_down_is_one_warning_within_seconds(tmp_path, monkeypatch, capsys, free_port):
    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)  # (and each restored after: the sink sets its defaults)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.monotonic()
    sink = TrackerSink(["mlflow"], tmp_path, {"train": {}})
    assert time.monotonic() - t0 < 60  # MLflow's own retries: 250 s here
    assert sink.trackers == {}
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: report_to mlflow: could not start (MlflowException: API request to http://")
