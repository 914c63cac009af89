"""Spec fuzzer: every mutated or hostile spec is accepted or refused with located problems, never a traceback.

A fixed hostile corpus (one case per failure found by an earlier fuzzing run) plus property-based mutations of
the shipped graphs/*.yaml: ~1,060 specs, derandomized so CI sees the same ones, each under a time bound.
"""

from __future__ import annotations

import contextlib
import copy
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from masgraph.errors import SpecError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec

ROOT = Path(__file__).resolve().parents[3]
TEXTS = {p.stem: p.read_text() for p in sorted((ROOT / "graphs").glob("*.yaml"))}
DOCS = {name: yaml.safe_load(text) for name, text in TEXTS.items()}
AGENTFLOW = TEXTS["agentflow"]
HANG_S = 10  # a case past this is a hang; typical cases take a few ms
FUZZ = settings(derandomize=True, database=None, deadline=timedelta(seconds=5),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextlib.contextmanager
def _time_bound(seconds: int):
    def hang(signum, frame):
        raise TimeoutError(f"validate hung for more than {seconds}s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def validate(data: str | bytes) -> SpecError | None:
    """What `masgraph validate` does; a refusal must locate every problem (path, and line:column)."""
    with _time_bound(HANG_S):
        try:
            compile_spec(parse_spec(data, "fuzz.yaml"), "fuzz.yaml")
        except SpecError as exc:
            assert exc.problems and str(exc)
            for p in exc.problems:
                assert isinstance(p.path, str) and p.line is not None and p.column is not None, p
                assert len(p.render("fuzz.yaml")) < 2000, p  # long values are shortened in messages
            return exc
    return None


# ---- the fixed hostile corpus -------------------------------------------------------------------------

def _bomb(levels: int = 9) -> str:
    parts = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    parts += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "{" + ", ".join(parts) + "}"


def _sub(old: str, new: str, text: str = AGENTFLOW) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


PYTHON_TOOL = "python: {kind: python, timeout_s: 10}"
PLANNER_MODEL = "    model: smollm2-135m\n    adapter: planner"
HOSTILE: dict[str, tuple[str | bytes, str | None, str]] = {  # name -> (spec, problem path, text in the message)
    "deep_flow_lists": (AGENTFLOW + "x: " + "[" * 500 + "]" * 500 + "\n", "x[0][0]", "deeper than 64"),
    "deep_flow_maps": (AGENTFLOW + "x: " + "{a: " * 500 + "1" + "}" * 500 + "\n", "x.a.a", "deeper than 64"),
    "deep_block_lists": (AGENTFLOW + "x:\n" + "".join(" " * i + "-\n" for i in range(500)), "x[0]", "deeper than 64"),
    "not_utf8": (AGENTFLOW.encode().replace(b"Planner /", b"Planner \xe9/"), "", "not UTF-8"),
    "utf16": (AGENTFLOW.encode("utf-16"), "", "not UTF-8"),
    "long_model_name": (_sub(PLANNER_MODEL, "    model: " + "m" * 5000 + "\n    adapter: planner"),
                        "policies.planner.model", "is not installed"),
    "nul_in_model_name": (_sub(PLANNER_MODEL, '    model: "a\\0b"\n    adapter: planner'),
                          "policies.planner.model", "is not installed"),
    "huge_int": (_sub("max_turns: 3", "max_turns: " + "9" * 5000), "limits.max_turns", "4300 digits"),
    "huge_negative_int": (_sub("steps: 20", "steps: -" + "1" * 4400), "train.steps", "4300 digits"),
    "huge_int_in_options": (_sub(PYTHON_TOOL, "python: {kind: python, options: {memory_mb: " + "7" * 4301 + "}}"),
                            "tools.python.options.memory_mb", "4300 digits"),
    "alias_bomb": (_sub(PYTHON_TOOL, "python: {kind: python, options: " + _bomb() + "}"),
                   "tools.python.options.a4", "aliases expand to more than"),
    "alias_bomb_merge_keys": (_sub(PYTHON_TOOL, "python: {kind: python, options: {b: " + _bomb()
                                   + ", c: {<<: *a8}}}"), "tools.python.options.b.a4", "aliases expand"),
    "recursive_alias": (_sub(PYTHON_TOOL, "python: &me {kind: python, options: {again: *me}}"),
                        "tools.python.options.again", "contains it"),
    "undefined_alias": (_sub(PYTHON_TOOL, "python: *nowhere"), "tools", "undefined alias"),
    "duplicate_top_key": (_sub("entry: planner", "entry: planner\nentry: generator"), "entry", "duplicate key"),
    "duplicate_node": (_sub("  verifier: {role: verifier, policy: verify}\n", "  verifier: {role: verifier, "
                            "policy: verify}\n  verifier: {role: generator, policy: fixed}\n"),
                       "nodes.verifier", "duplicate key"),
    "duplicate_flow_key": (_sub("{temperature: 0.0, max_tokens: 32}", "{temperature: 0.0, max_tokens: 32, "
                                "max_tokens: 9}"), "policies.planner.sampling.max_tokens", "duplicate key"),
    "unknown_tool_option": (_sub(PYTHON_TOOL, "python: {kind: python, options: {memory: 64}}"),
                            "tools.python.options.memory", "unknown key"),
    "tool_option_wrong_type": (_sub(PYTHON_TOOL, "python: {kind: python, options: {memory_mb: true}}"),
                               "tools.python.options.memory_mb", "valid integer"),
    "tool_option_out_of_range": (_sub("search: {kind: search}", "search: {kind: search, options: {top_k: 0}}"),
                                 "tools.search.options.top_k", "greater than or equal to 1"),
    "option_on_optionless_kind": (_sub("calculator: {kind: calculator}", "calculator: {kind: calculator, "
                                       "options: {digits: 3}}"), "tools.calculator.options.digits", "unknown key"),
    "unknown_prompt": (_sub("generator: {role: generator, policy: fixed}",
                            "generator: {role: generator, policy: fixed, prompt: nowhere}"),
                       "nodes.generator.prompt", "not a template"),
    "path_like_prompt": (_sub("generator: {role: generator, policy: fixed}",
                              "generator: {role: generator, policy: fixed, prompt: ../../pyproject}"),
                         "nodes.generator.prompt", "not a template"),
    "max_steps_below_shortest_path": (_sub("max_turns: 3,", "max_turns: 3, max_steps: 2,"),
                                      "limits.max_steps", "takes 4 steps"),
    "bool_for_int": (_sub("max_tokens: 32", "max_tokens: true"), "policies.planner.sampling.max_tokens",
                     "valid integer"),
    "bool_for_float": (_sub("episode_timeout_s: 300", "episode_timeout_s: yes"), "limits.episode_timeout_s",
                       "valid number"),
    "string_for_float": (_sub("lr: 0.001", "lr: '0.001'"), "train.flow_grpo.lr", "valid number"),
    "string_for_int": (_sub("eval_n: 32", "eval_n: '32'"), "train.eval_n", "valid integer"),
    "float_for_int": (_sub("eval_n: 32", "eval_n: 32.0"), "train.eval_n", "valid integer"),
    "impossible_date": (_sub("task: long_arithmetic", "task: 2024-13-45"), "train.task", "cannot read value"),
    "nul_character": (AGENTFLOW + "x: \x00\n", "", "U+0000"),
    "bell_character": (_sub("Planner /", "Planner \x07/"), "", "U+0007"),
    "lone_surrogate": (_sub("Planner /", "Planner \ud800/"), "", "U+D800"),
    "empty_file": ("", "", "must hold a mapping"),
    "only_comments": ("# nothing\n", "", "must hold a mapping"),
    "list_root": ("- name: x\n", "", "must hold a mapping"),
    "scalar_root": ("agentflow\n", "", "must hold a mapping"),
    "two_documents": (AGENTFLOW + "---\nname: again\n", "", "another document"),
    "unhashable_key": (_sub("search: {kind: search}", "search: {[a, b]: search}"), "", "unhashable key"),
    "python_tag": (_sub("search: {kind: search}", "search: !!python/object/apply:os.system [echo]"),
                   "", "constructor"),
    "tab_indent": (_sub("  planner:\n", "\tplanner:\n"), "", "YAML syntax"),
    "long_unknown_key": (_sub("entry: planner", "entry: planner\n? " + "k" * 100_000 + "\n: 1"),
                         "k" * 60, "unknown key"),
    "long_node_name": (_sub("exit: generator", "exit: " + "g" * 100_000), "exit", "is not a node"),
    "empty_nodes": (_sub("  planner: {role: planner, policy: planner}\n  executor: {role: executor, policy: fixed, "
                         "tools: [calculator, search, python]}\n  verifier: {role: verifier, policy: verify}\n  "
                         "generator: {role: generator, policy: fixed}\n", " {}\n"), "", "`nodes` is empty"),
    "nan_timeout": (_sub("episode_timeout_s: 300", "episode_timeout_s: .nan"), "limits.episode_timeout_s",
                    "greater than 0"),
    "negative_zero_turns": (_sub("max_turns: 3", "max_turns: -0"), "limits.max_turns", "greater than or equal"),
    "hex_int_accepted": (_sub("max_turns: 3", "max_turns: 0x3"), None, ""),
    "long_description_accepted": (_sub("description: Planner", "description: " + "é" * 1_000_000 + " Planner"),
                                  None, ""),
    "odd_unicode_accepted": (_sub("description: Planner", "description: \u202e\u200b\U0001f600 Planner"), None, ""),
    "shipped_agentflow": (AGENTFLOW, None, ""),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_spec_is_refused_with_a_located_problem(name):
    data, path, message = HOSTILE[name]
    err = validate(data)
    if path is None:
        assert err is None, str(err)
        return
    assert err is not None, f"{name} was accepted"
    assert any(p.path.startswith(path) and message in p.message for p in err.problems), str(err)[:2000]


# ---- property-based mutations of the shipped graphs ---------------------------------------------------

ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
FRAGMENTS = st.one_of(  # raw YAML put where a value was (all single-line, so they fit any indentation)
    st.sampled_from(["true", "no", "~", ".nan", "-.inf", "0x1F", "0o17", "1_000", "2024-13-45", "12:30:00",
                     "!!binary aGk=", "!!python/name:os.system", "*undefined", "&a x", "[*a]", "'unclosed", "{a: 1",
                     "!!str 8", "!!int x", "!!float nope", "<<: {a: 1}", "? [a]", "|", "@x", "%YAML", "- - -"]),
    st.integers(4290, 4400).map(lambda n: "9" * n),
    st.integers(1, 600).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 600).map(lambda n: "{a: " * n + "1" + "}" * n),
    st.integers(1, 9).map(_bomb),
    st.integers(1, 200_000).map(lambda n: "'" + "x" * n + "'"),
    ODD_TEXT.map(lambda s: yaml.safe_dump(s, width=10**9, allow_unicode=True).splitlines()[0]),
)
VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ODD_TEXT,
                   st.lists(st.integers(), max_size=3), st.dictionaries(ODD_TEXT, st.integers(), max_size=3))


def _random_path(data: st.DataObject, doc: object) -> list:
    """A key path into the document, stopping at a random depth."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    return path


def _mutate(data: st.DataObject, doc: dict, holes: list[str]) -> None:
    path = _random_path(data, doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1] if path else None
    op = data.draw(st.sampled_from(["delete", "retype", "fragment", "new_key", "share", "nest"]))
    if key is None or op == "new_key":
        target = parent if key is None else parent[key]
        if isinstance(target, dict):
            target[data.draw(ODD_TEXT)] = data.draw(VALUES)
    elif op == "delete":
        del parent[key]
    elif op == "retype":
        parent[key] = data.draw(VALUES)
    elif op == "fragment":
        holes.append(data.draw(FRAGMENTS))
        parent[key] = f"__HOLE_{len(holes) - 1}__"
    elif op == "share":  # the same object in two places: the dumper writes an anchor and an alias
        other = _random_path(data, doc)
        if other:
            holder = doc
            for k in other[:-1]:
                holder = holder[k]
            holder[other[-1]] = parent[key]
    else:
        value = parent[key]
        for _ in range(data.draw(st.integers(1, 80))):
            value = data.draw(st.sampled_from([[value], {"k": value}]))
        parent[key] = value


@pytest.mark.slow
@settings(FUZZ, max_examples=500)
@given(st.data())
def test_mutated_documents_are_accepted_or_refused_with_located_problems(data):
    doc = copy.deepcopy(DOCS[data.draw(st.sampled_from(sorted(DOCS)))])
    holes: list[str] = []
    for _ in range(data.draw(st.integers(1, 4))):
        _mutate(data, doc, holes)
    text = yaml.safe_dump(doc, allow_unicode=data.draw(st.booleans()), sort_keys=False, width=10**9)
    for i, hole in enumerate(holes):
        text = text.replace(f"__HOLE_{i}__", hole)
    validate(text)


@pytest.mark.slow
@settings(FUZZ, max_examples=380)
@given(st.data())
def test_mutated_texts_are_accepted_or_refused_with_located_problems(data):
    lines = TEXTS[data.draw(st.sampled_from(sorted(TEXTS)))].splitlines(keepends=True)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["duplicate", "delete", "insert", "truncate", "swap", "replace_word"]))
        if op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "delete" and len(lines) > 1:
            del lines[i]
        elif op == "insert":
            at = data.draw(st.integers(0, len(lines[i])))
            lines[i] = lines[i][:at] + data.draw(ODD_TEXT) + lines[i][at:]
        elif op == "truncate":
            lines = lines[:i] + [lines[i][:data.draw(st.integers(0, len(lines[i])))]]
        elif op == "swap":
            j = data.draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        else:
            words = lines[i].replace(",", " ").replace("}", " ").split()
            if words:
                lines[i] = lines[i].replace(data.draw(st.sampled_from(words)), data.draw(FRAGMENTS), 1)
    validate("".join(lines))


@settings(FUZZ, max_examples=130)
@given(st.sampled_from(sorted(TEXTS)), st.integers(0, 10**6), st.binary(min_size=1, max_size=8),
       st.sampled_from(["utf-8", "utf-8-sig", "latin-1", "utf-16", "cp1252"]))
def test_mutated_bytes_are_accepted_or_refused_with_located_problems(name, where, junk, encoding):
    raw = TEXTS[name].replace("Planner", "Plänner €").encode(encoding, errors="replace")
    at = where % (len(raw) + 1)
    validate(raw[:at] + junk + raw[at:])
