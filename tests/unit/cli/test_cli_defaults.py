"""Every default of a `masgraph` flag is read from the config model (or function) the flag sets, never restated as
a literal: a default written twice drifts."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import subprocess
import sys

import pytest

from masgraph.cli import TrainProgress, build_parser
from masgraph.runtime.runner import RunConfig
from masgraph.serve.server import ServeConfig, serve
from masgraph.watch import watch

CLI_OWNED = {
    ("serve", "--host"): "the address to bind: no config model holds it",
    ("serve", "--port"): "the port to bind: no config model holds it",
    ("topology", "--queries"): "queries shown by the report: no config model holds it",
    ("train", "--learner-timeout"): "the learner ranks' collective timeout: no config model holds it "
                                    "(masgraph.learn.data_parallel.TIMEOUT_S, held equal by test_learners_cli)",
}
"""Flags whose literal default is the command line's own."""

SOURCES = {
    ("run", "--n"): (RunConfig, "n"),
    ("run", "--split"): (RunConfig, "split"),
    ("run", "--samples"): (RunConfig, "samples"),
    ("run", "--concurrency"): (RunConfig, "concurrency"),
    ("run", "--seed"): (RunConfig, "seed"),
    ("run", "--deterministic"): (RunConfig, "deterministic"),
    ("run", "--runs-dir"): (RunConfig, "runs_dir"),
    ("train", "--runs-dir"): (RunConfig, "runs_dir"),
    ("train", "--progress-every"): (TrainProgress, "every_s"),
    ("watch", "--poll"): (watch, "poll_s"),
    ("serve", "--max-concurrency"): (ServeConfig, "max_concurrency"),
    ("serve", "--max-queue"): (ServeConfig, "max_queue"),
    ("serve", "--max-wait"): (ServeConfig, "max_wait_s"),
    ("serve", "--timeout"): (ServeConfig, "timeout_s"),
    ("serve", "--max-connections"): (ServeConfig, "max_connections"),
    ("serve", "--max-body-kb"): (ServeConfig, "max_body_bytes"),
    ("serve", "--runs-dir"): (RunConfig, "runs_dir"),
    ("serve", "--log-level"): (serve, "log_level"),
}
"""The model field each model-backed flag sets."""


def _default(source, name):
    """`source`'s own default of `name`, read here independently of masgraph.cli.flags."""
    if dataclasses.is_dataclass(source):
        return getattr(source(), name)
    return inspect.signature(source).parameters[name].default


def _flags():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield command, action.option_strings[0], action


def test_no_flag_restates_a_default_as_a_literal():
    literal = [(command, flag, action.default) for command, flag, action in _flags()
               if action.default not in (None, False) and not hasattr(action, "model_default")
               and (command, flag) not in CLI_OWNED]
    assert not literal, f"flags with a literal default (use flags.model_flag, or list them in CLI_OWNED): {literal}"


def test_no_cli_default_differs_from_its_models():
    seen = set()
    for command, flag, action in _flags():
        if not hasattr(action, "model_default"):
            continue
        source, field, to_flag = action.model_default
        assert (source, field) == SOURCES.get((command, flag)), (command, flag)
        expected = _default(source, field)
        assert action.default == (expected if to_flag is None else to_flag(expected)), (command, flag)
        seen.add((command, flag))
    assert seen == set(SOURCES)


def test_the_defaults_parsed_make_the_models_defaults():
    args = build_parser().parse_args(["run", "g.yaml", "--task", "t"])
    config = RunConfig(n=args.n, split=args.split, samples=args.samples, concurrency=args.concurrency,
                       seed=args.seed, deterministic=args.deterministic, runs_dir=args.runs_dir)
    assert config == RunConfig()
    args = build_parser().parse_args(["serve", "g.yaml"])
    assert ServeConfig(max_body_bytes=args.max_body_kb * 1024, max_concurrency=args.max_concurrency,
                       max_queue=args.max_queue, max_wait_s=args.max_wait, timeout_s=args.timeout,
                       max_connections=args.max_connections) == ServeConfig()


@pytest.mark.parametrize("argv", [["validate", "--help"], ["--help"]])
def test_a_command_builds_only_its_own_flags(argv):
    """`masgraph validate` does not import the server or the runner to read defaults it does not use."""
    code = ("import sys\nfrom masgraph.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('masgraph.server', 'masgraph.runtime.runner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]"
