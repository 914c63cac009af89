"""What a bundle's graph may name on disk: its plugin files and search indexes stay inside the bundle, and every
plugin that runs is covered by the manifest's hashes; anything else is refused at load, by `serve` and `run BUNDLE`
alike, before a plugin runs or an index is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from masgraph.errors import MasgraphError
from masgraph.serve.agent import open_source
from masgraph.serve.bundle import export_bundle, load_bundle
from masgraph.serve.manifest import graph_references, sha256_file

SCRIPTED = ("name: s\npolicies:\n  main: {backend: scripted}\n"
            "nodes:\n  answer: {role: generator, policy: main}\nentry: answer\nexit: answer\n")
SEARCH = SCRIPTED + "tools:\n  search: {kind: search}\n"


def bundle_of(tmp_path: Path, text: str = SCRIPTED, **files: str) -> Path:
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "g.yaml").write_text(text)
    for name, body in files.items():
        (folder / name).write_text(body)
    return export_bundle(folder / "g.yaml", tmp_path / "deep" / "er" / "b")


def rewrite_graph(bundle: Path, change) -> None:
    """Edit graph.yaml and make the manifest agree (a bundle's author can: the manifest is not signed)."""
    graph = yaml.safe_load((bundle / "graph.yaml").read_text())
    change(graph)
    (bundle / "graph.yaml").write_text(yaml.safe_dump(graph, sort_keys=False))
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["graph.yaml"] = {"sha256": sha256_file(bundle / "graph.yaml"),
                                       "size": (bundle / "graph.yaml").stat().st_size}
    (bundle / "manifest.json").write_text(json.dumps(manifest))


EVIL = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('plugin ran')\n"


def outside_plugin(bundle: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "evil_plugin.py").write_text(EVIL)
    return ["../../../evil_plugin.py", str(tmp_path / "evil_plugin.py")]


@pytest.mark.parametrize("which", [0, 1])
def test_a_plugin_outside_the_bundle_is_refused_before_it_runs(tmp_path, capsys, which):
    from masgraph.cli import main

    bundle = bundle_of(tmp_path)
    name = outside_plugin(bundle, tmp_path)[which]
    rewrite_graph(bundle, lambda g: g.update(plugins=[name]))
    with pytest.raises(MasgraphError, match=r"`plugins\[0\]`.*relative path inside the bundle"):
        load_bundle(bundle)
    for command in (["run", str(bundle), "--task", "basic_arithmetic", "--n", "1"],
                    ["serve", str(bundle), "--port", "0", "--no-store"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "plugins[0]" in err and "Traceback" not in err
    assert not (tmp_path / "RAN").exists()


def test_a_plugin_linked_out_of_the_bundle_is_refused(tmp_path):
    bundle = bundle_of(tmp_path)
    outside_plugin(bundle, tmp_path)
    (bundle / "plugins").mkdir()
    (bundle / "plugins" / "evil_plugin.py").symlink_to(tmp_path / "evil_plugin.py")
    rewrite_graph(bundle, lambda g: g.update(plugins=["plugins/evil_plugin.py"]))
    with pytest.raises(MasgraphError, match=r"plugins/ is not in the manifest"):  # the link: refused, unlisted
        open_source(bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    with pytest.raises(MasgraphError, match=r"`plugins\[0\]`.*outside the bundle"):
        graph_references(bundle, manifest, "b")  # and the reference itself, followed through the link
    assert not (tmp_path / "RAN").exists()


def test_a_plugin_file_the_manifest_does_not_cover_is_refused(tmp_path):
    """A plugin inside the bundle and hashed in `files`, but not listed in the manifest's `plugins`, or the other
    way round: the manifest must say what runs."""
    bundle = bundle_of(tmp_path, SCRIPTED + "plugins: [plug.py]\n", **{"plug.py": "OK = 1\n"})
    assert load_bundle(bundle).manifest["plugins"] == ["plugins/plug.py"]
    rewrite_graph(bundle, lambda g: g.update(plugins=["plugins/plug.py", "prompts/direct.txt.py"]))
    with pytest.raises(MasgraphError, match=r"`plugins\[1\]`.*manifest does not cover"):
        load_bundle(bundle)
    rewrite_graph(bundle, lambda g: g.update(plugins=["plugins/plug.py", "os"]))
    with pytest.raises(MasgraphError, match=r"`plugins\[1\]` names module 'os'"):
        load_bundle(bundle)


@pytest.mark.parametrize("index", ["../../../outside.fts", "/ABS/outside.fts"])
def test_a_search_index_outside_the_bundle_is_refused_and_never_written(tmp_path, capsys, index):
    from masgraph.cli import main

    bundle = bundle_of(tmp_path, SEARCH)
    index = index.replace("/ABS", str(tmp_path))
    rewrite_graph(bundle, lambda g: g["tools"]["search"].update(options={"index": index}))
    with pytest.raises(MasgraphError, match=r"`tools.search.options.index`.*inside the bundle"):
        open_source(bundle)
    assert main(["run", str(bundle), "--task", "basic_arithmetic", "--n", "1"]) == 2
    assert "tools.search.options.index" in capsys.readouterr().err
    assert not (tmp_path / "outside.fts").exists()


def test_a_search_index_inside_the_bundle_is_built_there_and_the_bundle_loads_again(tmp_path, monkeypatch):
    bundle = bundle_of(tmp_path, SEARCH)
    rewrite_graph(bundle, lambda g: g["tools"]["search"].update(options={"index": "index/kb.fts"}))
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # a relative index resolves against the bundle, not the working directory
    graph, loaded = open_source(bundle)
    assert loaded is not None and (bundle / "index" / "kb.fts").is_file() and not any(elsewhere.iterdir())
    assert graph.spec.tools["search"].options["index"] == str((bundle / "index" / "kb.fts").resolve())
    open_source(bundle)  # the index it built is not an unlisted file
    (bundle / "index" / "other.fts").write_text("planted")
    with pytest.raises(MasgraphError, match="index/other.fts is not in the manifest"):
        load_bundle(bundle)
