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
                              sha256s, every file's sha256, tools, the held-out evaluation at export

`load_bundle` checks the manifest before anything loads: a missing or altered file, other base weights or other
prompt text than the bundle was exported with, is refused with the reason."""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from importlib import metadata
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from masgraph.checkpoint import TOPOLOGY_FILE, checkpoint_adapters, read_state, resolve_checkpoint
from masgraph.errors import MasgraphError

__all__ = ["FORMAT_VERSION", "Bundle", "export_bundle", "load_bundle"]

FORMAT = "masgraph-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Bundle:
    """A checked bundle: where it is, its manifest, and what to build an agent from."""

    path: Path
    manifest: dict[str, Any]

    @property
    def graph_file(self) -> Path:
        return self.path / "graph.yaml"

    @property
    def adapters(self) -> dict[str, Path]:
        return {name: self.path / "adapters" / name for name in self.manifest["adapters"]}

    @property
    def topology_file(self) -> Path | None:
        return self.path / TOPOLOGY_FILE if self.manifest.get("topology") else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    if not (run / "spec.yaml").is_file():
        raise MasgraphError(f"{run} has no spec.yaml, so the graph {checkpoint} was trained with is unknown; pass the "
                            "training run directory (or RUN/checkpoints/step-N inside it)")
    step = read_state(checkpoint).get("step")
    return _read_yaml(run / "spec.yaml"), checkpoint, {"kind": "run", "path": str(run.resolve()),
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
    from masgraph.store import read_jsonl

    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return None
    at = [r for r in read_jsonl(metrics) if r.get("step") == step and "accuracy/test" in r]  # cut lines skipped
    if not at:
        return None
    cfg: dict[str, Any] = {}
    config = run / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text()).get("config", {})
    task, n = cfg.get("task"), (cfg.get("train") or {}).get("eval_n")
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


def _prompt_dir() -> Path:
    return Path(str(files("masgraph.agents") / "prompts"))


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
    from masgraph import __version__
    from masgraph.store import package_versions

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
    plugins = []
    for p in graph.get("plugins") or []:
        path = Path(p)
        if p.endswith(".py"):
            if not path.is_file():
                raise MasgraphError(f"plugin {p} (named by the graph) is missing; export needs it to ship it")
            (dst / "plugins").mkdir(exist_ok=True)
            shutil.copy2(path, dst / "plugins" / path.name)
            plugins.append(f"plugins/{path.name}")
        else:
            plugins.append(p)  # an installed module: the manifest lists it; the target must have it
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
        "files": {str(p.relative_to(dst)): sha256_file(p) for p in sorted(dst.rglob("*")) if p.is_file()},
    }


def _unpack(path: Path) -> Path:
    """A .tar.gz bundle unpacked next to itself (once), refusing members that would land outside."""
    target = path.with_name(path.name.removesuffix(".tar.gz"))
    if target.is_dir():
        return target
    try:
        with tarfile.open(path) as tar:
            tar.extractall(path.parent, filter="data")  # refuses absolute paths, .., devices, links out
    except (tarfile.TarError, OSError) as exc:
        raise MasgraphError(f"cannot unpack bundle archive {path}: {exc}") from None
    if not target.is_dir():
        raise MasgraphError(f"{path} does not unpack to {target.name}/; it is not a masgraph bundle archive")
    return target


def load_bundle(path: str | Path) -> Bundle:
    """Check a bundle against its manifest (format, every file's sha256, base weights, prompts) and return it;
    a mismatch is refused with the reason."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".tar.gz"):
        path = _unpack(path)
    where = f"bundle {path}"
    if not (path / MANIFEST).is_file():
        raise MasgraphError(f"{where} has no {MANIFEST}; pass a directory written by `masgraph export`")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except json.JSONDecodeError as exc:
        raise MasgraphError(f"{where}: {MANIFEST} is not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise MasgraphError(f"{where}: {MANIFEST} is not a masgraph bundle manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise MasgraphError(f"{where} has format version {manifest.get('format_version')}; this masgraph reads "
                            f"version {FORMAT_VERSION} (export it again with this masgraph)")
    for rel, digest in manifest.get("files", {}).items():
        file = path / rel
        if not file.is_file():
            raise MasgraphError(f"{where} is incomplete: {rel} is missing")
        if sha256_file(file) != digest:
            raise MasgraphError(f"{where}: {rel} does not match its sha256 in the manifest (altered or corrupt)")
    for rel in ("graph.yaml", *(f"adapters/{a}/adapter_model.safetensors" for a in manifest.get("adapters", {}))):
        if rel not in manifest.get("files", {}):
            raise MasgraphError(f"{where}: the manifest does not cover {rel}")
    _check_models(manifest, where)
    _check_prompts(path, where)
    return Bundle(path, manifest)


def _check_models(manifest: dict[str, Any], where: str) -> None:
    from masgraph.model import resolve_model

    for model, info in manifest.get("models", {}).items():
        if not info.get("weights"):
            continue
        directory = resolve_model(model)
        for name, digest in info["weights"].items():
            file = directory / name
            if not file.is_file() or sha256_file(file) != digest:
                raise MasgraphError(f"{where} was exported for other weights of base model {model!r} ({name} "
                                    f"sha256 {digest[:12]}…); the installed {directory} differs, so its adapters "
                                    "would not mean the same")


def _check_prompts(path: Path, where: str) -> None:
    """The templates this masgraph renders must be the bundle's (prompt text is part of the trained agent)."""
    installed = _prompt_dir()
    for file in sorted((path / "prompts").glob("*.txt")):
        mine = installed / file.name
        if not mine.is_file() or mine.read_bytes() != file.read_bytes():
            raise MasgraphError(f"{where}: prompt template {file.name} differs from this masgraph's "
                                f"({metadata.version('masgraph')}); serve it with the masgraph it was exported "
                                "with")
