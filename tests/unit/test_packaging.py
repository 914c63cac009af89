"""agents/ and trainers/ install only as masgraph.agents / masgraph.trainers: no generic top-level names."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import venv

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
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # pip of the outer environment installs into the new venv's site-packages, offline, no build isolation
    site = subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()
    build = tmp_path / "build"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", site, str(root)],
                   check=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(build.parent)})
    probe = (
        "import importlib.util, masgraph, masgraph.agents, masgraph.trainers, masgraph.agents.tools.calculator;"
        "assert importlib.util.find_spec('agents') is None, 'agents importable';"
        "assert importlib.util.find_spec('trainers') is None, 'trainers importable';"
        f"assert masgraph.agents.__file__.startswith({str(site)!r}), masgraph.agents.__file__;"
        "from masgraph.agents.prompting import load_template; load_template('planner');"
        "from masgraph.tasks import load_kb; assert load_kb()['people'];"
        "from masgraph.registry import default_registry; r = default_registry();"  # found through entry points
        "assert 'planner' in r.agents and 'calculator' in r.tools and 'flow_grpo' in r.algorithms, r;"
        "print('ok')")
    out = subprocess.run([str(py), "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
