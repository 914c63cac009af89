"""A bundle's manifest: its format, limits and schema, and the checks that a bundle on disk is exactly what was
exported."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from importlib import metadata
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, NonNegativeInt, StringConstraints, ValidationError

from masgraph.errors import MasgraphError, shorten


def _prompt_dir() -> Path:
    return Path(str(files("masgraph.agents") / "prompts"))


_Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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


def _check_files(path: Path, manifest: dict[str, Any], where: str, built: frozenset[str] = frozenset()) -> None:
    """The bundle holds exactly the manifest's files, each a regular file of its size and sha256 (and `built`, the
    search indexes its graph builds inside it: data, never run): sizes and the tree are checked before anything is
    hashed, so a wrong file costs no read."""
    listed = manifest["files"]
    _drop_bytecode(path, where)
    _check_tree(path, listed, where, built)
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


_SQLITE_SIDECARS = ("", "-journal", "-wal", "-shm")
"""What SQLite writes beside a database: a built search index is these files."""


def _check_tree(path: Path, listed: dict[str, Any], where: str, built: frozenset[str] = frozenset()) -> None:
    """Every entry under the bundle is the manifest, a listed regular file or a directory above one (or a search
    index of `built`): an extra file (a new adapter, a plugin), a symbolic link or a device is refused, by name."""
    def unreadable(exc: OSError) -> None:
        raise MasgraphError(f"{where}: cannot list {exc.filename}: {exc.strerror or exc}")

    products = {rel + suffix for rel in built for suffix in _SQLITE_SIDECARS}
    listed = {**listed, **dict.fromkeys(products)}
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


def graph_references(path: Path, manifest: dict[str, Any], where: str) -> dict[str, str]:
    """Check what the bundle's graph names on disk, before anything of it loads: each `plugins:` file is a file
    the bundle ships (under it, listed in the manifest's files and `plugins`, so hashed), each module name one the
    manifest lists; each tool's `index:` is a path inside the bundle (relative, no `..`, no link out). Returns
    {tool: index path relative to the bundle} (the index is built there, resolved against the bundle)."""
    try:
        raw = yaml.safe_load((path / "graph.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise MasgraphError(f"{where}: cannot read graph.yaml: {exc}") from None
    if not isinstance(raw, dict):
        raise MasgraphError(f"{where}: graph.yaml is not a graph (a YAML mapping)")
    root = path.resolve()
    plugins, shipped = raw.get("plugins") or [], manifest.get("plugins") or []
    if not isinstance(plugins, list):
        raise MasgraphError(f"{where}: graph.yaml `plugins` is not a list")
    for i, name in enumerate(plugins):
        key = f"plugins[{i}]"
        if not isinstance(name, str):
            raise MasgraphError(f"{where}: graph.yaml `{key}` is not a module name or a .py file")
        if name.endswith(".py"):
            rel = _inside(root, name, where, key, "a plugin file")
            if rel not in manifest["files"] or name not in shipped:
                raise MasgraphError(f"{where}: graph.yaml `{key}` names {name!r}, which the manifest does not cover "
                                    "(its files and `plugins` must both list it, so its sha256 is checked before it "
                                    "runs); export the bundle again")
        elif name not in shipped:
            raise MasgraphError(f"{where}: graph.yaml `{key}` names module {name!r}, which the manifest's `plugins` "
                                "does not list; export the bundle again")
    indexes: dict[str, str] = {}
    tools = raw.get("tools") or {}
    for tool, spec in tools.items() if isinstance(tools, dict) else ():
        options = spec.get("options") if isinstance(spec, dict) else None
        if isinstance(options, dict) and options.get("index") is not None:
            key = f"tools.{tool}.options.index"
            indexes[str(tool)] = _inside(root, options["index"], where, key, "a search index")
    return indexes


def _inside(root: Path, name: Any, where: str, key: str, what: str) -> str:
    """`name` as a path relative to the bundle directory `root` that stays inside it, followed through any links;
    else a MasgraphError naming `key`."""
    pure = PurePosixPath(name) if isinstance(name, str) else None
    if pure is None or not name or "\0" in name or pure.is_absolute() or ".." in pure.parts:
        raise MasgraphError(f"{where}: graph.yaml `{key}` is {shorten(repr(name))}: {what} of a bundle must be a "
                            "relative path inside the bundle (no absolute path, no `..`)")
    resolved = (root / pure).resolve()
    if not resolved.is_relative_to(root):
        raise MasgraphError(f"{where}: graph.yaml `{key}` is {name!r}, which leads outside the bundle (through a "
                            f"symbolic link) to {resolved}; {what} of a bundle must stay inside it")
    return resolved.relative_to(root).as_posix()


