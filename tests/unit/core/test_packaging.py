"""agents/ and trainers/ install only as masgraph.agents / masgraph.trainers: no generic top-level names; a
non-editable install (`pip install .`, a wheel) ships every package folder of the source tree."""

from __future__ import annotations

import importlib.util
import site as sitemod
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest


def test_no_generic_top_level_names_in_this_process():
    assert importlib.util.find_spec("agents") is None
    assert importlib.util.find_spec("trainers") is None
    import masgraph.agents
    import masgraph.trainers

    assert masgraph.agents.__name__ == "masgraph.agents" and masgraph.trainers.__name__ == "masgraph.trainers"


@pytest.mark.slow
def test_non_editable_install_imports_from_outside_the_repo(root, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # pip of the outer environment installs into the new venv's site-packages, offline, no build isolation
    site = subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    # masgraph's dependencies come from the outer environment's site-packages (a path line per folder: its own
    # .pth files, e.g. the editable install of masgraph, are not processed); the base Python's packages may lack
    # them (a system Python), so `system_site_packages` would make this test depend on the machine
    (Path(site) / "outer.pth").write_text("".join(p + "\n" for p in sitemod.getsitepackages()))
    build = tmp_path / "build"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", site, str(root)],
                   check=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(build.parent)})
    probe = (
        "import importlib.util, masgraph, masgraph.agents, masgraph.trainers, masgraph.agents.tools.calculator;"
        "assert all(importlib.util.find_spec(m) for m in ('masgraph.topology', 'masgraph.watch', 'masgraph.memory',"
        "  'masgraph.runtime', 'masgraph.rundir', 'masgraph.serve', 'masgraph.learn', 'masgraph.backends.hf',"
        "  'masgraph.cli'));"
        "assert importlib.util.find_spec('agents') is None, 'agents importable';"
        "assert importlib.util.find_spec('trainers') is None, 'trainers importable';"
        f"assert masgraph.agents.__file__.startswith({str(site)!r}), masgraph.agents.__file__;"
        "from masgraph.agents.prompting import load_template; load_template('planner');"
        "from masgraph.tasks import load_kb; assert load_kb()['people'];"
        "from masgraph.registry import default_registry; r = default_registry();"  # found through entry points
        "assert 'planner' in r.agents and 'calculator' in r.tools and 'flow_grpo' in r.algorithms, r;"
        "assert {'hf', 'vllm', 'litellm'} <= set(r.backends), r.backends;"  # the backends' entry point
        "print('ok')")
    out = subprocess.run([str(py), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_package_folder_is_listed_in_pyproject(root):
    """pyproject lists packages by hand (agents/ and trainers/ install under masgraph.), so a new package folder must
    be added there; masgraph.topology and masgraph.watch were missing until a bare GPU machine installed masgraph
    into a --target dir and `import masgraph.trainers.loop` failed."""
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        base = root / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "__pycache__" not in rel.parts:
                found.add(".".join((name, *rel.parts)))
    assert {"masgraph", "masgraph.agents", "masgraph.trainers"} <= found
    def folder(name: str) -> Path:
        base = max((p for p in tool["package-dir"] if name == p or name.startswith(p + ".")), key=len)
        return root / tool["package-dir"][base] / Path(*name[len(base):].split(".")[1:])

    data_only = {name for name in tool["package-data"] if not list(folder(name).glob("*.py"))}
    assert data_only == {"masgraph.graphs"}  # the example graphs, package data only
    assert found - listed == set(), f"package folders missing from pyproject's packages: {sorted(found - listed)}"
    assert listed - found == data_only, f"pyproject lists packages with no folder: {sorted(listed - found)}"


@pytest.mark.slow
def test_the_wheel_holds_the_graphs_the_typing_marker_and_the_license(root, tmp_path):
    """What `pip install masgraph` gets beyond the code (issue 57 #15-#16): the example graphs `masgraph init` copies,
    py.typed, LICENSE, `python -m masgraph`. (The whole path, a fresh venv from the index running the README's
    quickstart, is the manual check in docs/getting-started.md: it downloads torch.)"""
    import zipfile

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path), str(root)], check=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin",
                                                                                  "TMPDIR": str(tmp_path)})
    [wheel] = tmp_path.glob("masgraph-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    graphs = {f"masgraph/graphs/{p.name}" for p in (root / "graphs").glob("*.yaml")}
    assert graphs and graphs <= names
    assert {"masgraph/py.typed", "masgraph/__main__.py", "masgraph/cli/init.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("agents/", "trainers/", "graphs/")) for n in names)  # no generic top-level names
