"""`masgraph topology RUN` says what each block of probabilities is (issue 57 #14: it and watch's graph view printed
different numbers for one run, neither labelled), and says when it cannot load the run's task (#11: it silently
showed the prior only)."""

from __future__ import annotations

import json

from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.topology.policy import load_policy
from masgraph.topology.report import describe


def test_each_block_says_what_it_is(root):
    policy = load_policy(compile_spec(load_spec(root / "graphs" / "mixed_router.yaml")))
    assert policy.conditioned
    text = describe(policy, ["What is 2 + 3?"], source="checkpoint step-3")
    assert "(query-conditioned) from checkpoint step-3;" in text.splitlines()[0]
    assert "held-out query 'What is 2 + 3?':" in text and "(prior)" not in text
    assert "`masgraph watch` shows another number: the mean over a training step's queries" in text
    assert "prior (no query):" in describe(policy)


def test_a_run_whose_task_cannot_be_loaded_is_a_note(tmp_path, capsys):
    from masgraph.cli.topology import run_task

    (tmp_path / "config.json").write_text(json.dumps({"config": {"task": f"data:{tmp_path / 'gone.jsonl'}"}}))
    assert run_task(tmp_path) is None
    err = capsys.readouterr().err
    assert err.startswith(f"note: {tmp_path}: its task 'data:{tmp_path / 'gone.jsonl'}' cannot be loaded here (")
    assert "showing the policy at no query only (no per-query rows)" in err
