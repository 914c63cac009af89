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
import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from importlib import metadata
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, NonNegativeInt, StringConstraints, ValidationError

from masgraph.checkpoint import TOPOLOGY_FILE, checkpoint_adapters, read_state, resolve_checkpoint
from masgraph.errors import MasgraphError, shorten

__all__ = ["FORMAT_VERSION", "Bundle", "export_bundle", "load_bundle"]

FORMAT = "masgraph-bundle"
FORMAT_VERSION = 2
"""2: `files` maps each path to its sha256 and size (1: to its sha256 alone)."""
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20
"""Largest manifest.json read (an exported one is a few kB)."""
MAX_MEMBER_BYTES = 2 << 30
"""Largest file a bundle archive may unpack (a LoRA adapter of a 7B model at rank 64 is ~0.6 GiB in float32; a
bigger bundle ships as a directory)."""
MAX_ARCHIVE_BYTES = 8 << 30
"""Most bytes a bundle archive may unpack in all (a small .tar.gz can hold terabytes of zeros)."""
MAX_MEMBERS = 10_000
"""Most entries a bundle archive may hold (an exported one holds tens)."""


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
    from masgraph._version import __version__
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


def _unpack(archive: Path) -> tuple[Path, dict[str, Any]]:
    """A NAME.tar.gz bundle as the directory NAME/ beside it, checked, with its manifest.

    Every member is checked from its header before a byte is written: a regular file or a directory under NAME/
    (no link, device, absolute or '..' path), within MAX_MEMBER_BYTES, MAX_ARCHIVE_BYTES in all and MAX_MEMBERS, and
    the files exactly those the archive's manifest lists, of their sizes. Then the archive unpacks into a fresh
    private directory beside itself, is checked against the manifest there (sha256s) and becomes NAME/ in one
    rename, so a refused or interrupted unpack never leaves a NAME/ that a later load would take.
    An existing NAME/ (a previous unpack) is used only if it holds exactly what the archive's manifest lists: the
    same manifest, every file matching it, nothing more. Any other NAME/ is refused, never overwritten or merged."""
    top = archive.name.removesuffix(".tar.gz")
    if not top:
        raise MasgraphError(f"cannot unpack bundle archive {archive}: name it BUNDLE.tar.gz (it unpacks to BUNDLE/)")
    target, where = archive.with_name(top), f"bundle archive {archive}"
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = _members(tar, top, where)
            manifest = _archive_manifest(tar, members, top, where)
            if not os.path.lexists(target) and _unpack_into_place(tar, members, manifest, target, where):
                return target, manifest
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:  # not a .tar.gz, truncated, no room, ...
        raise MasgraphError(f"cannot unpack {where}: {exc}") from None
    _check_unpacked(target, manifest, archive)
    return target, manifest


def _members(tar: tarfile.TarFile, top: str, where: str) -> list[tarfile.TarInfo]:
    """The archive's entries, each checked from its header (nothing is extracted here): under `top`/, a regular
    file or directory, no name twice, within the size and count caps; the first bad one is named."""
    members: list[tarfile.TarInfo] = []
    names: set[str] = set()
    total = 0
    for member in tar:  # headers one at a time: a bomb of entries stops at the cap
        name = shorten(member.name, 200)
        pure = PurePosixPath(member.name)
        if len(members) == MAX_MEMBERS:
            raise MasgraphError(f"cannot unpack {where}: it holds more than {MAX_MEMBERS} entries")
        if "\0" in member.name or str(pure) != member.name or ".." in pure.parts or pure.parts[:1] != (top,):
            raise MasgraphError(f"cannot unpack {where}: member {name!r} is not inside {top}/ (an absolute path, '..' "
                                f"or another folder); {top}.tar.gz from `masgraph export` unpacks to {top}/ only")
        if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE):
            kind = "a symbolic link" if member.issym() else "a hard link" if member.islnk() else "a special file"
            raise MasgraphError(f"cannot unpack {where}: member {name!r} is {kind}; a bundle archive holds regular "
                                "files and directories only")
        if member.name in names:
            raise MasgraphError(f"cannot unpack {where}: member {name!r} appears twice")
        if member.size > MAX_MEMBER_BYTES:
            raise MasgraphError(f"cannot unpack {where}: member {name!r} is {member.size} bytes, over the "
                                f"{MAX_MEMBER_BYTES} a bundle archive's file may have (ship a bundle this big as "
                                "a directory)")
        total += member.size
        if total > MAX_ARCHIVE_BYTES:
            raise MasgraphError(f"cannot unpack {where}: its members pass the {MAX_ARCHIVE_BYTES} bytes a bundle "
                                f"archive may unpack to at {name!r} (ship a bundle this big as a directory)")
        names.add(member.name)
        members.append(member)
    return members


def _archive_manifest(tar: tarfile.TarFile, members: list[tarfile.TarInfo], top: str,
                      where: str) -> dict[str, Any]:
    """The archive's manifest, checked, after checking that its files are exactly the manifest's, of their sizes,
    and its directories only those above them."""
    files = {m.name.removeprefix(f"{top}/"): m for m in members if m.isfile()}
    if MANIFEST not in files:
        raise MasgraphError(f"cannot unpack {where}: it has no {top}/{MANIFEST}; it is not a masgraph bundle archive")
    if files[MANIFEST].size > MAX_MANIFEST_BYTES:
        raise MasgraphError(f"cannot unpack {where}: its {MANIFEST} is over {MAX_MANIFEST_BYTES} bytes")
    manifest = _parse_manifest(tar.extractfile(files.pop(MANIFEST)).read(), where)  # type: ignore[union-attr]
    listed = manifest["files"]
    if extra := sorted(files.keys() - listed.keys()):
        raise MasgraphError(f"cannot unpack {where}: member {files[extra[0]].name} is not in its manifest")
    if missing := sorted(listed.keys() - files.keys()):
        raise MasgraphError(f"cannot unpack {where}: {missing[0]} (in its manifest) is missing from it")
    for rel, entry in listed.items():
        if files[rel].size != entry["size"]:
            raise MasgraphError(f"cannot unpack {where}: member {files[rel].name} is {files[rel].size} bytes, its "
                                f"manifest says {entry['size']}")
    dirs = {PurePosixPath(top, rel).parent for rel in listed} | {PurePosixPath(top)}
    dirs |= {parent for d in list(dirs) for parent in d.parents}
    for member in members:
        if member.isdir() and PurePosixPath(member.name) not in dirs:
            raise MasgraphError(f"cannot unpack {where}: member {member.name}/ is not in its manifest")
    return manifest


def _unpack_into_place(tar: tarfile.TarFile, members: list[tarfile.TarInfo], manifest: dict[str, Any],
                       target: Path, where: str) -> bool:
    """Unpack the checked members into a fresh private directory beside `target`, check them there against the
    manifest and rename them to `target`; False if another process made `target` first. Nothing is left behind
    but `target`, complete."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))  # 0700: private while unchecked
    try:
        # the stdlib's extraction filter as well as our checks, where this Python has one (3.11.4+; 3.11.0-3.11.3
        # take no `filter` argument, and the members were already checked above)
        tar.extractall(tmp, members=members, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        unpacked = tmp / target.name
        _check_files(unpacked, manifest, f"{where} (unpacked)")
        try:
            os.rename(unpacked, target)
        except OSError:
            if os.path.lexists(target):
                return False
            raise
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_unpacked(target: Path, manifest: dict[str, Any], archive: Path) -> None:
    """An existing `target` beside the archive must be the archive's bundle: a real directory with the same
    manifest and exactly the files it lists (a half-unpacked, edited or unrelated one is refused, untouched)."""
    try:
        if target.is_symlink() or not target.is_dir():
            raise MasgraphError("it is not a directory")
        if _read_manifest(target, str(target)) != manifest:
            raise MasgraphError(f"its {MANIFEST} differs from the archive's")
        _check_files(target, manifest, str(target))
    except MasgraphError as exc:
        raise MasgraphError(f"{target} already exists beside {archive.name} and is not the archive's bundle ({exc}); "
                            f"move it away and load the archive again, or load {target} itself") from None


def load_bundle(path: str | Path) -> Bundle:
    """Check a bundle against its manifest (format, every file's size and sha256 and nothing else there, base
    weights, prompts) and return it; a mismatch is refused with the reason."""
    path = Path(path)
    if path.is_file() and path.name.endswith(".tar.gz"):
        path, manifest = _unpack(path)  # checked as it unpacks
    else:
        manifest = _read_manifest(path, f"bundle {path}")
        _check_files(path, manifest, f"bundle {path}")
    where = f"bundle {path}"
    _check_models(manifest, where)
    _check_prompts(path, where)
    return Bundle(path, manifest)


def _relative(rel: str) -> str:
    """A manifest path: relative, canonical (no '.', '..' or empty parts) and not the manifest itself, so it
    names a file inside the bundle."""
    pure = PurePosixPath(rel)
    if ("\0" in rel or not pure.parts or pure.is_absolute() or str(pure) != rel or ".." in pure.parts
            or rel == MANIFEST):
        raise ValueError(f"{rel!r} is not a relative path inside the bundle")
    return rel


def _single(name: str) -> str:
    """A name used as one path component (an adapter's directory, a weight file)."""
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a plain file or directory name")
    return name


_Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _File(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    sha256: _Sha256
    size: NonNegativeInt


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    weights: dict[Annotated[str, AfterValidator(_single)], _Sha256] | None = None


class _Manifest(BaseModel):
    """The parts of manifest.json that loading relies on, typed (the rest is there for people to read)."""

    model_config = ConfigDict(strict=True, extra="allow")
    files: dict[Annotated[str, AfterValidator(_relative)], _File]
    adapters: dict[Annotated[str, AfterValidator(_single)], dict[str, Any]]
    models: dict[str, _Model] = {}
    topology: dict[str, Any] | None = None


def _read_manifest(path: Path, where: str) -> dict[str, Any]:
    """The bundle's manifest.json, a regular file of at most MAX_MANIFEST_BYTES, parsed and checked."""
    file = path / MANIFEST
    try:
        info = file.lstat()
    except OSError:
        raise MasgraphError(f"{where} has no {MANIFEST}; pass a directory written by `masgraph export`") from None
    if not stat.S_ISREG(info.st_mode):
        raise MasgraphError(f"{where}: {MANIFEST} is not a regular file (a symbolic link or other); export again")
    if info.st_size > MAX_MANIFEST_BYTES:
        raise MasgraphError(f"{where}: {MANIFEST} is {info.st_size} bytes, over the {MAX_MANIFEST_BYTES} a manifest "
                            "may have; it is not a masgraph bundle manifest")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise MasgraphError(f"{where}: cannot read {MANIFEST}: {exc.strerror or exc}") from None
    return _parse_manifest(data, where)


def _parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """A manifest's bytes as its dict: UTF-8 JSON of this format and version, shaped as `_Manifest`, covering the
    graph and each adapter's weights; anything else is a MasgraphError that says what is wrong."""
    try:
        manifest = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise MasgraphError(f"{where}: {MANIFEST} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:
        raise MasgraphError(f"{where}: {MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise MasgraphError(f"{where}: {MANIFEST} is not a masgraph bundle manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise MasgraphError(f"{where} has format version {shorten(repr(manifest.get('format_version')))}; this "
                            f"masgraph reads version {FORMAT_VERSION} (export it again with this masgraph)")
    try:
        _Manifest.model_validate(manifest)
    except ValidationError as exc:
        raise MasgraphError(f"{where}: {MANIFEST} is malformed: {_first_problem(exc)}") from None
    for rel in ("graph.yaml", *(f"adapters/{a}/adapter_model.safetensors" for a in manifest["adapters"])):
        if rel not in manifest["files"]:
            raise MasgraphError(f"{where}: the manifest does not cover {rel}")
    return manifest


def _first_problem(exc: ValidationError) -> str:
    """`files['x'].size: Input should be ...` for the first of a validation error's problems."""
    first, *_ = exc.errors()
    loc = [str(part) for part in first["loc"]]
    at = loc[0] + "".join(" (the key)" if part == "[key]" else f"[{shorten(part)!r}]" for part in loc[1:])
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{at}: {first['msg'].removeprefix('Value error, ')}{more}"


def _check_files(path: Path, manifest: dict[str, Any], where: str) -> None:
    """The bundle holds exactly the manifest's files, each a regular file of its size and sha256: sizes and the
    tree are checked before anything is hashed, so a wrong file costs no read."""
    listed = manifest["files"]
    _drop_bytecode(path, where)
    _check_tree(path, listed, where)
    for rel, entry in listed.items():
        try:
            info = (path / rel).lstat()
        except OSError:
            raise MasgraphError(f"{where} is incomplete: {rel} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise MasgraphError(f"{where}: {rel} is not a regular file (a symbolic link, directory or other)")
        if info.st_size != entry["size"]:
            raise MasgraphError(f"{where}: {rel} is {info.st_size} bytes, the manifest says {entry['size']} "
                                "(altered or corrupt)")
    for rel, entry in listed.items():
        if sha256_file(path / rel) != entry["sha256"]:
            raise MasgraphError(f"{where}: {rel} does not match its sha256 in the manifest (altered or corrupt)")


def _check_tree(path: Path, listed: dict[str, Any], where: str) -> None:
    """Every entry under the bundle is the manifest, a listed regular file or a directory above one: an extra
    file (a new adapter, a plugin), a symbolic link or a device is refused, by name."""
    def unreadable(exc: OSError) -> None:
        raise MasgraphError(f"{where}: cannot list {exc.filename}: {exc.strerror or exc}")

    dirs = {str(parent) for rel in listed for parent in PurePosixPath(rel).parents}
    for root, dirnames, filenames in os.walk(path, onerror=unreadable):  # links are listed, never followed
        for name in sorted(dirnames + filenames):
            entry = Path(root, name)
            rel = entry.relative_to(path).as_posix()
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                raise MasgraphError(f"{where}: {rel} is a symbolic link; a bundle holds regular files only")
            if (stat.S_ISDIR(mode) and rel in dirs) or (stat.S_ISREG(mode) and (rel in listed or rel == MANIFEST)):
                continue
            raise MasgraphError(f"{where}: {rel}{'/' if stat.S_ISDIR(mode) else ''} is not in the manifest (added "
                                "after export?); remove it, or export the bundle again")


def _drop_bytecode(path: Path, where: str) -> None:
    """Remove plugins/__pycache__: Python writes it when a bundle's plugin is imported, and would run a .pyc
    there instead of the verified plugin source, so none may survive the check (it is rebuilt on import)."""
    cache = path / "plugins" / "__pycache__"
    if not (path / "plugins").is_symlink() and cache.is_dir() and not cache.is_symlink():  # links: refused later
        try:
            shutil.rmtree(cache)
        except OSError as exc:
            raise MasgraphError(f"{where}: cannot remove plugins/__pycache__ (bytecode the manifest does not cover): "
                                f"{exc.strerror or exc}") from None


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
