"""Unpacking a bundle archive (BUNDLE.tar.gz) beside itself, checked before anything lands there."""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any

from masgraph.errors import MasgraphError, shorten
from masgraph.serve.manifest import (
    MANIFEST,
    MAX_ARCHIVE_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_MEMBER_BYTES,
    MAX_MEMBERS,
    _check_files,
    _parse_manifest,
    _read_manifest,
    graph_references,
)


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
        indexes = graph_references(target, manifest, str(target))  # search indexes built there by a load
        _check_files(target, manifest, str(target), frozenset(indexes.values()))
    except MasgraphError as exc:
        raise MasgraphError(f"{target} already exists beside {archive.name} and is not the archive's bundle ({exc}); "
                            f"move it away and load the archive again, or load {target} itself") from None
