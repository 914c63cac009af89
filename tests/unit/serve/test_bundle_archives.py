"""Bundle archives (`masgraph export --archive`) from a hostile source: every member is checked before anything is
written, a refused archive leaves nothing behind, and a BUNDLE/ already beside the archive is used only when it is
exactly the archive's bundle."""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

import masgraph.serve.archive
from masgraph.cli import main
from masgraph.errors import MasgraphError
from masgraph.serve.bundle import export_bundle, load_bundle

SCRIPTED = ("name: s\npolicies:\n  main: {backend: scripted}\n"
            "nodes:\n  answer: {role: generator, policy: main}\nentry: answer\nexit: answer\n")


def exported(tmp_path: Path, text: str = SCRIPTED, name: str = "b") -> Path:
    """A bundle directory of a model-free graph (in its own folder, away from where archives are loaded)."""
    src = tmp_path / "src" / name
    src.mkdir(parents=True)
    (src / "s.yaml").write_text(text)
    return export_bundle(src / "s.yaml", src / "bundle")


def member(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
           link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def archive(folder: Path, bundle: Path, extra: Callable[[tarfile.TarFile], None] = lambda tar: None,
            top: str = "b") -> Path:
    """folder/b.tar.gz holding `bundle` as `top`/, then whatever `extra` adds."""
    path = folder / "b.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(bundle, arcname=top)
        extra(tar)
    return path


@pytest.fixture
def place(tmp_path: Path) -> Path:
    """Where archives are loaded from, with a file of the user's beside them."""
    folder = tmp_path / "place"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    return folder


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _same_size_edit(bundle: Path) -> Path:
    """A copy of `bundle` whose graph.yaml differs in one byte (so only its sha256 can tell)."""
    copy = bundle.with_name(bundle.name + "-edited")
    shutil.copytree(bundle, copy)
    data = (copy / "graph.yaml").read_bytes()
    (copy / "graph.yaml").write_bytes(data[:-2] + b"X\n")
    return copy


HOSTILE = {  # name: (archive(place, bundle), what the refusal says)
    "a file beside the archive": (lambda p, b: archive(p, b, lambda t: member(t, "notes.txt", b"pwned")),
                                  "member 'notes.txt' is not inside b/"),
    "a hard link, then a write through it": (
        lambda p, b: archive(p, b, lambda t: (member(t, "b/h", kind=tarfile.LNKTYPE, link="notes.txt"),
                                              member(t, "b/h", b"pwned"))), "member 'b/h' is a hard link"),
    "a symbolic link out": (lambda p, b: archive(p, b, lambda t: member(t, "b/s", kind=tarfile.SYMTYPE,
                                                                        link="../notes.txt")),
                            "member 'b/s' is a symbolic link"),
    "a device": (lambda p, b: archive(p, b, lambda t: member(t, "b/dev", kind=tarfile.CHRTYPE)),
                 "member 'b/dev' is a special file"),
    "an absolute path": (lambda p, b: archive(p, b, lambda t: member(t, "/abs.txt", b"x")),
                         "member '/abs.txt' is not inside b/"),
    "a '..' path": (lambda p, b: archive(p, b, lambda t: member(t, "b/../escaped.txt", b"x")),
                    "member 'b/../escaped.txt' is not inside b/"),
    "another top folder": (lambda p, b: archive(p, b, top="other"), "member 'other' is not inside b/"),
    "a file the manifest does not list": (
        lambda p, b: archive(p, b, lambda t: member(t, "b/adapters/evil/adapter_model.safetensors", b"x")),
        "member b/adapters/evil/adapter_model.safetensors is not in its manifest"),
    "a name twice": (lambda p, b: archive(p, b, lambda t: member(t, "b/graph.yaml", b"name: other\n")),
                     "member 'b/graph.yaml' appears twice"),
    "a file altered after export": (lambda p, b: archive(p, _same_size_edit(b)),
                                    "graph.yaml does not match its sha256"),
    "not a gzip file": (lambda p, b: _garbage(p / "b.tar.gz"), "cannot unpack bundle archive"),
    "a truncated archive": (lambda p, b: _truncated(archive(p, b)), "cannot unpack bundle archive"),
}


def _garbage(path: Path) -> Path:
    path.write_bytes(b"not an archive")
    return path


def _truncated(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-200])
    return path


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_archive_is_refused_and_leaves_nothing(tmp_path, place, capsys, case):
    """HEAD: notes.txt was overwritten (twice), /abs.txt and other/ landed beside the archive, the altered graph
    was extracted, and a refused archive left a b/ that the next load accepted."""
    build, match = HOSTILE[case]
    path = build(place, exported(tmp_path))
    before = listing(place)
    for _ in range(2):  # nothing half-unpacked is left for a second load to accept
        with pytest.raises(MasgraphError, match=match):
            load_bundle(path)
        assert listing(place) == before and (place / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "escaped.txt").exists() and not (tmp_path / "abs.txt").exists()
    assert main(["run", str(path), "--task", "basic_arithmetic", "--n", "1"]) == 2  # the CLI stops: one line
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("cap, value, match", [
    ("MAX_MEMBER_BYTES", 64, r"member 'b/\S+' is \d+ bytes, over the 64 a bundle archive's file may have"),
    ("MAX_ARCHIVE_BYTES", 1000, r"its members pass the 1000 bytes a bundle archive may unpack to at 'b/\S+'"),
    ("MAX_MEMBERS", 3, "it holds more than 3 entries"),
])
def test_an_archive_over_a_size_cap_is_refused_from_its_headers(tmp_path, place, monkeypatch, cap, value, match):
    """The caps are checked on each member's header, before anything is written (HEAD unpacked any size)."""
    path = archive(place, exported(tmp_path))
    monkeypatch.setattr(masgraph.serve.archive, cap, value)  # the unpacker reads the caps
    extracted = []
    monkeypatch.setattr(tarfile.TarFile, "extractall", lambda *a, **k: extracted.append(a))
    with pytest.raises(MasgraphError, match=match):
        load_bundle(path)
    assert extracted == [] and listing(place) == ["b.tar.gz", "notes.txt"]


def test_an_archive_unpacks_once_beside_itself_and_loads_again(tmp_path, place):
    path = archive(place, exported(tmp_path))
    first = load_bundle(path)
    assert first.path == place / "b" and listing(place)[:2] == ["b", "b.tar.gz"]
    assert not [p for p in place.iterdir() if p.name.startswith(".")]  # no private unpack folder left
    assert load_bundle(path).manifest == first.manifest  # the b/ it unpacked is the archive's: used as it is


@pytest.mark.parametrize("existing", ["another bundle", "a half-unpacked one", "an edited one", "a file"])
def test_an_existing_folder_that_is_not_the_archives_bundle_is_refused_untouched(tmp_path, place, existing):
    """HEAD loaded whatever b/ was beside b.tar.gz instead of the archive's contents."""
    path = archive(place, exported(tmp_path))
    target = place / "b"
    if existing == "another bundle":
        shutil.copytree(exported(tmp_path, SCRIPTED.replace("name: s", "name: impostor"), "impostor"), target)
    elif existing == "a half-unpacked one":
        target.mkdir()
        (target / "graph.yaml").write_text("name: s\n")
    elif existing == "an edited one":
        load_bundle(path)
        (target / "graph.yaml").write_text((target / "graph.yaml").read_text() + "# edited\n")
    else:
        target.write_text("mine too")
    before = {p: p.read_bytes() for p in place.rglob("*") if p.is_file()}
    with pytest.raises(MasgraphError, match=r"already exists beside b.tar.gz and is not the archive's bundle"):
        load_bundle(path)
    assert {p: p.read_bytes() for p in place.rglob("*") if p.is_file()} == before
