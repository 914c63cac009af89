"""Deployable bundles: a trained graph exported as one self-describing directory (or .tar.gz), loadable with no
training run around.

    BUNDLE/
      graph.yaml              the deployment graph: the `train:` section dropped, plugins pointing into plugins/
      adapters/<name>/        each trained adapter in PEFT format (adapter_config.json + adapter_model.safetensors),
                              loadable as it is by `peft` and by vLLM's LoRA loader
      topology.pt             the learned topology policy (parameters and version only), served greedy or sampled
      prompts/<name>.txt      the prompt templates the graph runs with
      plugins/<file>.py       the custom agents/tools modules the graph names in `plugins:` (single-file ones)
      manifest.json           format version, masgraph and package versions, each base model's id and weight
                              sha256s, every file's sha256 and size, tools, the held-out evaluation at export

`load_bundle` checks the manifest before anything loads: a malformed manifest, a missing, altered or extra file,
a symbolic link, other base weights or other prompt text than the bundle was exported with, is refused with the
reason (sizes first, so a wrong file is refused before it is hashed).

BUNDLE.tar.gz (`export --archive`) unpacks beside itself as BUNDLE/, checked before anything lands there (see
`_unpack`): a refused archive leaves nothing behind, and an existing BUNDLE/ is used only when it holds exactly the
archive's files; any other BUNDLE/ is refused, never overwritten or merged into."""

from __future__ import annotations

import datetime as _dt
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from masgraph.errors import MasgraphError
from masgraph.rundir.checkpoint import TOPOLOGY_FILE, checkpoint_adapters, read_state, resolve_checkpoint
from masgraph.rundir.layout import CONFIG, METRICS, SPEC
from masgraph.serve.archive import _unpack
from masgraph.serve.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    _check_files,
    _check_models,
    _check_prompts,
    _prompt_dir,
    _read_manifest,
    graph_references,
    sha256_file,
)

__all__ = ["FORMAT_VERSION", "Bundle", "export_bundle", "load_bundle"]


@dataclass(frozen=True)
class Bundle:
    """A checked bundle: where it is, its manifest, and what to build an agent from."""

    path: Path
    manifest: dict[str, Any]
    indexes: dict[str, str] = field(default_factory=dict)
    """{tool: its search index's path relative to the bundle}: built inside the bundle, never outside it."""

    @property
    def graph_file(self) -> Path:
        return self.path / "graph.yaml"

    @property
    def adapters(self) -> dict[str, Path]:
        return {name: self.path / "adapters" / name for name in self.manifest["adapters"]}

    @property
    def topology_file(self) -> Path | None:
        return self.path / TOPOLOGY_FILE if self.manifest.get("topology") else None


def _source(source: str | Path) -> tuple[dict[str, Any], Path | None, dict[str, Any]]:
    """(raw graph YAML, checkpoint or None, what the manifest says about the source) of a run dir, a checkpoint
    dir or a graph file."""
    path = Path(source)
    if not path.exists():
        raise MasgraphError(f"{path} does not exist; export a training run directory, RUN/checkpoints/step-N or a "
                            "graph YAML file")
    if path.is_file():
        return _read_yaml(path), None, {"kind": "graph", "path": str(path.resolve())}
    checkpoint = resolve_checkpoint(path)
    run = checkpoint.parent.parent
    if not (run / SPEC).is_file():
        raise MasgraphError(f"{run} has no spec.yaml, so the graph {checkpoint} was trained with is unknown; pass the "
                            "training run directory (or RUN/checkpoints/step-N inside it)")
    step = read_state(checkpoint).get("step")
    return _read_yaml(run / SPEC), checkpoint, {"kind": "run", "path": str(run.resolve()),
                                                       "checkpoint": checkpoint.name, "step": step}


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise MasgraphError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise MasgraphError(f"{path} is not a graph file (a YAML mapping)")
    return data


def _evaluation(run: Path, step: int | None) -> dict[str, Any] | None:
    """The training run's held-out evaluation at the exported step (from metrics.jsonl), with its command."""
    from masgraph.rundir.read import read_json
    from masgraph.rundir.store import read_jsonl

    metrics = run / METRICS
    if not metrics.is_file():
        return None
    at = [r for r in read_jsonl(metrics) if r.get("step") == step and "accuracy/test" in r]  # cut lines skipped
    if not at:
        return None
    cfg: dict[str, Any] = {}
    config = run / CONFIG
    if config.is_file():  # read as every run-dir reader reads (a value nested too deep is unreadable, not a crash)
        cfg = ((read_json(config) or {}).get("config") or {})
        cfg = cfg if isinstance(cfg, dict) else {}
    # the episodes the evaluation ran (fewer than eval_n when the task holds out fewer items; older runs: eval_n)
    task, n = cfg.get("task"), at[-1].get("episodes/test", (cfg.get("train") or {}).get("eval_n"))
    n = int(n) if isinstance(n, float) and n.is_integer() else n
    return {"step": step, "accuracy": at[-1]["accuracy/test"], "task": task, "n": n, "split": "test",
            "source": "the training run's held-out evaluation (metrics.jsonl)",
            "command": f"masgraph run BUNDLE --task {task} --n {n} --deterministic" if task else None}


def _models(raw: dict[str, Any]) -> dict[str, Any]:
    """Each hf policy's base model: its id and the sha256 of its weight files (what adapters were trained on)."""
    from masgraph.model import resolve_model

    out: dict[str, Any] = {}
    for pol in (raw.get("policies") or {}).values():
        model, backend = pol.get("model"), pol.get("backend", "hf")
        if model in out or model is None:
            continue
        if backend != "hf":
            out[model] = {"backend": backend, "weights": None}
            continue
        directory = resolve_model(model)
        out[model] = {"backend": backend, "weights": {p.name: sha256_file(p)
                                                      for p in sorted(directory.glob("*.safetensors"))}}
    return out




def export_bundle(source: str | Path, out: str | Path, archive: bool = False) -> Path:
    """Write a bundle of a training run (its latest checkpoint), a checkpoint, or a plain graph to `out`
    (refused if `out` exists and is not empty); returns the bundle directory, or the .tar.gz with `archive`."""
    raw, checkpoint, source_info = _source(source)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MasgraphError(f"{out} already exists and is not empty; pick a new --out (nothing is overwritten)")
    parent = out.parent if out.parent != Path("") else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
    try:
        manifest = _write(raw, checkpoint, source_info, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if archive:
            target = out.with_name(out.name + ".tar.gz") if not out.name.endswith(".tar.gz") else out
            with tarfile.open(target, "w:gz") as tar:
                tar.add(tmp, arcname=target.name.removesuffix(".tar.gz"))
            return target
        if out.exists():
            out.rmdir()
        tmp.rename(out)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write(raw: dict[str, Any], checkpoint: Path | None, source_info: dict[str, Any], dst: Path) -> dict[str, Any]:
    from masgraph._version import __version__
    from masgraph.rundir.store import package_versions

    graph = {k: v for k, v in raw.items() if k != "train"}
    # a deployable agent runs where it is served: the training machine's device is not the serving one's
    # (`masgraph serve --device` pins one there)
    if isinstance(graph.get("policies"), dict):
        graph["policies"] = {n: {**p, "device": "auto"} if isinstance(p, dict) and "device" in p else p
                             for n, p in graph["policies"].items()}
    adapters: dict[str, Any] = {}
    if checkpoint is not None:
        for name, adapter_dir in checkpoint_adapters(checkpoint).items():
            shutil.copytree(adapter_dir, dst / "adapters" / name)
            adapters[name] = {"path": f"adapters/{name}"}
    topology = None
    if graph.get("topology") is not None and checkpoint is not None and (checkpoint / TOPOLOGY_FILE).is_file():
        import torch

        state = torch.load(checkpoint / TOPOLOGY_FILE, weights_only=True, map_location="cpu")
        torch.save({"policy": state["policy"], "version": state["version"], "decisions": state.get("decisions")},
                   dst / TOPOLOGY_FILE)  # parameters only: the optimizer state is for training
        topology = {"file": TOPOLOGY_FILE, "version": state["version"], "mode": "greedy"}
    plugins = _ship_plugins(graph.get("plugins") or [], _graph_folder(source_info), dst)
    if plugins:
        graph["plugins"] = plugins
    shutil.copytree(_prompt_dir(), dst / "prompts", ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "graph.yaml").write_text(f"# exported by masgraph {__version__} from {source_info['path']}\n"
                                    + yaml.safe_dump(graph, sort_keys=False))
    run = Path(source_info["path"]) if source_info["kind"] == "run" else None
    for name, info in adapters.items():
        info["sha256"] = sha256_file(dst / "adapters" / name / "adapter_model.safetensors")
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "name": graph.get("name"),
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "masgraph": __version__, "packages": package_versions(), "source": source_info,
        "models": _models(graph), "adapters": adapters, "topology": topology,
        "tools": {name: (t or {}).get("kind", name) for name, t in (graph.get("tools") or {}).items()},
        "plugins": plugins,
        "evaluation": _evaluation(run, source_info.get("step")) if run is not None else None,
        "files": {p.relative_to(dst).as_posix(): {"sha256": sha256_file(p), "size": p.stat().st_size}
                  for p in sorted(dst.rglob("*")) if p.is_file()},
    }


def _graph_folder(source_info: dict[str, Any]) -> Path:
    """The folder of the graph file exported (a run's is its spec.yaml's): its `plugins:` files resolve there."""
    path = Path(source_info["path"])
    return path.parent if source_info["kind"] == "graph" else path


def _ship_plugins(names: Any, base: Path, dst: Path) -> list[str]:
    """Copy the graph's plugin files into dst/plugins/ and return `plugins:` as the bundle names them. A .py file
    resolves against `base`, the graph's folder, as `load_spec` resolves it (not against the current directory);
    a dotted module name is kept (the manifest lists it; the target must have it installed)."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MasgraphError("the graph's `plugins:` must be a list of module names or .py files")
    shipped: list[str] = []
    for name in names:
        if not name.endswith(".py"):
            shipped.append(name)
            continue
        path = base / name
        if not path.is_file():
            raise MasgraphError(f"plugin {name} (named by the graph) is missing: no file {path}; export needs it "
                                "to ship it")
        rel = f"plugins/{path.name}"
        if rel in shipped:
            raise MasgraphError(f"plugins {name} and another one are both named {path.name}; the bundle ships them "
                                "side by side in plugins/, so rename one")
        (dst / "plugins").mkdir(exist_ok=True)
        shutil.copy2(path, dst / rel)
        shipped.append(rel)
    return shipped


def load_bundle(path: str | Path) -> Bundle:
    """Check a bundle against its manifest (format, every file's size and sha256 and nothing else there, base
    weights, prompts), and that its graph reaches nothing outside it (`graph_references`), and return it; a mismatch
    is refused with the reason."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".tar.gz"):
        path, manifest = _unpack(path)  # checked as it unpacks
        indexes = graph_references(path, manifest, f"bundle {path}")
    else:
        where = f"bundle {path}"
        manifest = _read_manifest(path, where)
        try:  # what a load may have built inside it; graph.yaml is hash-checked next, with the rest
            built = frozenset(graph_references(path, manifest, where).values())
        except MasgraphError:
            built = frozenset()  # refused below, after the files are checked
        _check_files(path, manifest, where, built)
        indexes = graph_references(path, manifest, where)
    where = f"bundle {path}"
    _check_models(manifest, where)
    _check_prompts(path, where)
    return Bundle(path, manifest, indexes)
