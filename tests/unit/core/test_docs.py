"""Every fenced code block in README.md and docs/**/*.md is run or validated, and README.md stays a quickstart.

- yaml: a whole graph is loaded and compiled as `masgraph validate` does; a fragment says where it belongs in an HTML
  comment just above it: `<!-- docs-test: into graphs/X.yaml -->` (its top-level keys replace the base graph's, its
  `nodes:` / `tools:` / `policies:` entries replace or add the base's, then the result is compiled; `... with
  data/F.jsonl` first writes a one-document search corpus there) or
  `<!-- docs-test: task-file -->` (a data task file, `--task data:FILE`);
- python: executed, in a fresh interpreter (plugins register globally), in a scratch directory; a block marked
  `<!-- docs-test: file NAME -->` is also written there as NAME, for a graph fragment's `plugins:`. A block that
  needs what a test cannot have (the model decoding for minutes, a live server, a bundle) is in COMPILE_ONLY with
  the reason: it is compiled and each of its imports resolved (module and name);
- bash: each `masgraph ...` command is parsed by the CLI's own parser (a removed or misspelt flag fails), each
  `make X` names a Makefile target, each `python benchmarks/X.py` / `bash benchmarks/X.sh` names a file that exists;
- text: shown output, not checked. A block with no language fails: say what it is."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 300

# (page, a snippet of the block) -> why the block is only compiled and its imports resolved
COMPILE_ONLY = {
    ("README.md", "Runner(graph, RunConfig(n=16))"): "runs 16 episodes on the embedded model (minutes on a CPU)",
    ("docs/graphs.md", "Runner(graph, RunConfig(n=16))"): "runs 16 episodes on the embedded model (minutes on a CPU)",
    ("docs/graphs.md", "Engine(compile_spec("): "loads the embedded model and decodes two episodes",
    ("README.md", "OpenAI(base_url="): "a client of a running `masgraph serve`",
    ("docs/export-serve.md", "OpenAI(base_url="): "a client of a running `masgraph serve`",
    ("docs/training/memory.md", "OpenAI(base_url="): "a client of a running `masgraph serve` with a memory graph",
    ("docs/export-serve.md", 'load_agent("agent/")'): "needs a bundle written by `masgraph export` of a training run",
}
LANGS = {"yaml", "python", "bash", "text"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for path in PAGES:
        lines = path.read_text(encoding="utf-8").splitlines()
        page = path.relative_to(ROOT).as_posix()
        i = 0
        while i < len(lines):
            m = re.match(r"^```(\S*)\s*$", lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = MARKER.fullmatch(lines[k].strip()) if k >= 0 else None
            out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             marker.group(1) if marker else None))
            i = end + 1
    return out


BLOCKS = _blocks()


def _of(lang: str) -> list[Block]:
    return [b for b in BLOCKS if b.lang == lang]


def _compile_only(block: Block) -> str | None:
    return next((why for (page, snippet), why in COMPILE_ONLY.items()
                 if page == block.page and snippet in block.text), None)


def test_readme_is_a_quickstart():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_every_block_says_its_language():
    assert BLOCKS, "no code blocks found"
    bad = [f"{b.id} ```{b.lang}" for b in BLOCKS if b.lang not in LANGS]
    assert not bad, f"code blocks need one of {sorted(LANGS)}: {bad}"


def test_every_compile_only_entry_names_a_block():
    """An allow-list entry whose block is gone (or was edited) must go too, or it hides nothing."""
    stale = [k for k in COMPILE_ONLY
             if not any(b.page == k[0] and k[1] in b.text for b in _of("python"))]
    assert not stale, stale


# ---------------------------------------------------------------- python and yaml: one fresh interpreter for all

RUNNER = textwrap.dedent('''
    import ast, importlib, json, os, sys, traceback
    from pathlib import Path

    import yaml

    jobs = json.loads(Path(sys.argv[1]).read_text())
    root = Path(sys.argv[2])
    results = {}

    def merge(base, frag):
        for key, value in frag.items():
            if key in ("nodes", "tools", "policies") and isinstance(value, dict):
                base.setdefault(key, {}).update(value)
            else:
                base[key] = value
        return base

    def check_imports(tree):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        importlib.import_module(f"{node.module}.{alias.name}")

    for job in jobs:  # files first: graph fragments name them as plugins
        if job["kind"] == "python" and job["file"]:
            Path(job["file"]).write_text(job["text"])
    sys.path.insert(0, os.getcwd())
    from masgraph.tasks.data import DataTaskSpec
    from masgraph.graph import compile_spec
    from masgraph.loader import parse_spec

    for job in jobs:
        try:
            if job["kind"] == "python":
                tree = ast.parse(job["text"], job["id"])
                code = compile(tree, job["id"], "exec")
                if job["compile_only"]:
                    check_imports(tree)
                else:
                    exec(code, {"__name__": "__docs__"})
            elif job["kind"] == "task-file":
                raw = yaml.safe_load(job["text"])
                DataTaskSpec.model_validate({"file": "data.json", **raw})
            else:
                frag = yaml.safe_load(job["text"])
                for corpus in job["with"]:
                    Path(corpus).parent.mkdir(parents=True, exist_ok=True)
                    doc = {"id": "d1", "title": "Kalo Mira", "text": "Kalo Mira lives in Rafeport."}
                    Path(corpus).write_text(json.dumps(doc) + "\\n")
                if job["into"]:
                    base = yaml.safe_load((root / job["into"]).read_text())
                    frag = merge(base, frag)
                path = Path(job["id"].replace("/", "_").replace(":", "_") + ".yaml")
                path.write_text(yaml.safe_dump(frag, sort_keys=False))
                compile_spec(parse_spec(path.read_text(), str(path)), str(path))
            results[job["id"]] = None
        except BaseException:
            results[job["id"]] = traceback.format_exc(limit=6)
    print(json.dumps(results))
''')


def _job(block: Block) -> dict:
    marker = block.marker or ""
    if block.lang == "python":
        return {"id": block.id, "kind": "python", "text": block.text, "compile_only": _compile_only(block) is not None,
                "file": marker[5:].strip() if marker.startswith("file ") else None}
    if marker == "task-file":
        return {"id": block.id, "kind": "task-file", "text": block.text}
    m = re.fullmatch(r"(?:into (\S+))?(?: ?with (.+))?", marker)
    assert m, f"{block.id}: unknown docs-test marker {marker!r}"
    return {"id": block.id, "kind": "graph", "text": block.text, "into": m.group(1),
            "with": (m.group(2) or "").split()}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict[str, str | None]:
    work = tmp_path_factory.mktemp("docs-blocks")
    jobs = [_job(b) for b in _of("python") + _of("yaml")]
    (work / "jobs.json").write_text(json.dumps(jobs))
    (work / "runner.py").write_text(RUNNER)
    proc = subprocess.run([sys.executable, str(work / "runner.py"), str(work / "jobs.json"), str(ROOT)], cwd=work,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("block", _of("python") + _of("yaml"), ids=lambda b: b.id)
def test_block_runs_or_validates(block, checked):
    error = checked[block.id]
    assert error is None, f"{block.id} ({block.lang}{', compile only' if _compile_only(block) else ''}):\n{error}"


# ---------------------------------------------------------------- bash

def _commands(text: str) -> list[list[str]]:
    """Each simple command of a bash block as words: comments, continuations, env assignments and redirections
    removed, `&&` / `;` / `|` / `&` lists split."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for w in [*words, ";"]:
            if w in ("&&", "||", ";", "|", "&"):
                if current:
                    out.append(current)
                current = []
            elif re.fullmatch(r"\d?>>?|<", w):
                current.append(None)  # the next word is a redirection target
            elif current and current[-1] is None:
                current.pop()
            elif not current and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", w):
                continue
            else:
                current.append(w)
    return out


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"(?m)^([A-Za-z0-9][A-Za-z0-9_.-]*)\s*:(?!=)", text))


def _parse_masgraph(argv: list[str]) -> str | None:
    from masgraph.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        return f"exit {e.code}: {err.getvalue().strip()}"
    return None


def check_bash(block: Block) -> list[str]:
    problems, targets, seen = [], _make_targets(), 0
    for words in _commands(block.text):
        cmd, args = words[0], words[1:]
        if cmd.endswith("masgraph"):
            seen += 1
            if (why := _parse_masgraph(args)) is not None:
                problems.append(f"`masgraph {' '.join(args)}`: {why}")
        elif cmd == "make":
            seen += 1
            goals = [a for a in args if "=" not in a and not a.startswith("-")]
            problems += [f"`make {g}`: no such Makefile target" for g in goals if g not in targets]
        elif cmd.endswith("python") or cmd == "bash":
            scripts = [a for a in args if a.endswith((".py", ".sh"))][:1]
            seen += len(scripts)
            problems += [f"`{cmd} {s}`: no such file" for s in scripts if not (ROOT / s).is_file()]
    if not seen:
        problems.append("no masgraph / make / benchmark command to check in this block")
    return problems


@pytest.mark.parametrize("block", _of("bash"), ids=lambda b: b.id)
def test_bash_block_commands_exist(block):
    problems = check_bash(block)
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


def test_bash_check_catches_a_removed_flag_and_target():
    """The checker itself: a misspelt flag and an unknown make target fail."""
    bad = Block("x.md", 1, "bash", "masgraph run graphs/agentflow.yaml --task basic_arithmetic --nn 3\nmake docz\n",
                None)
    problems = check_bash(bad)
    assert len(problems) == 2 and "--nn" in problems[0] and "docz" in problems[1], problems
