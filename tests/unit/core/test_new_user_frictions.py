"""Issue 30, finding 12: the smaller frictions a new user hit (each test fails with its fix reverted)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from masgraph.errors import SpecError
from masgraph.loader import parse_spec

LOOP = """\
name: loop
policies:
  p: {backend: scripted}
tools:
  calculator: {kind: calculator}
nodes:
  verifier: {role: verifier, policy: p}
  planner: {role: planner, policy: p}
  executor: {role: executor, tools: [calculator]}
  generator: {role: generator, policy: p}
edges:
  - {source: planner, target: executor}
  - {source: executor, target: verifier}
  - {source: verifier, target: planner, when: continue}
  - {source: verifier, target: generator, when: stop}
entry: planner
exit: generator
"""


def _problems(text: str) -> list:
    from masgraph.graph import compile_spec

    with pytest.raises(SpecError) as info:
        compile_spec(parse_spec(text, "g.yaml"), "g.yaml")
    return info.value.problems


def test_an_unbounded_cycle_is_named_by_its_path_not_alphabetically():
    [p] = _problems(LOOP)
    assert p.path == "limits.max_turns"
    assert "cycle [verifier -> planner -> executor -> verifier] is unbounded" in p.message, p.message


def test_a_cycle_with_more_nodes_than_its_shortest_loop_says_how_many_more():
    text = LOOP.replace("  generator: {role: generator, policy: p}\n",
                        "  generator: {role: generator, policy: p}\n  checker: {role: generator, policy: p}\n")
    text = text.replace("  - {source: planner, target: executor}\n", "  - {source: planner, target: executor}\n"
                        "  - {source: executor, target: checker}\n  - {source: checker, target: planner}\n")
    [p] = _problems(text)
    assert "cycle [verifier -> planner -> executor -> verifier] (and 1 more node looping with it) is unbounded" \
        in p.message, p.message


def test_an_edge_to_a_misspelt_node_gets_did_you_mean():
    text = LOOP.replace("target: generator, when: stop", "target: genrator, when: stop")
    [p] = _problems(text + "limits: {max_turns: 3}\n")
    assert (p.message, p.fix) == ("'genrator' is not a node", "did you mean 'generator'?"), p
    far = LOOP.replace("target: generator, when: stop", "target: zzz, when: stop")
    [p] = _problems(far + "limits: {max_turns: 3}\n")
    assert "use one of ['executor', 'generator', 'planner', 'verifier']" in p.fix  # nothing close: the list


def _cli(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "masgraph.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env={**os.environ, "COLUMNS": "200"})


def test_run_help_shows_the_defaults_of_samples_and_concurrency():
    out = _cli("run", "--help").stdout
    assert "rollouts per item (default 1)" in out and "episodes in flight (default 16)" in out, out


@pytest.mark.slow
def test_validate_counts_in_the_singular_for_one(tmp_path, root):
    one_edge = tmp_path / "two.yaml"
    one_edge.write_text("name: two\npolicies: {p: {backend: scripted}}\nnodes:\n  a: {role: generator, policy: p}\n"
                        "  b: {role: generator, policy: p}\nedges: [{source: a, target: b}]\nentry: a\nexit: b\n")
    p = _cli("validate", "--no-model-check", str(root / "graphs" / "single.yaml"), str(one_edge))
    assert p.returncode == 0, p.stderr
    assert "(1 node, 0 edges)" in p.stdout and "(2 nodes, 1 edge)" in p.stdout, p.stdout


def test_approx_kl_on_policy_is_zero_never_negative():
    """k3 = exp(x) - 1 - x >= 0, but float32 rounds exp(x) to 1 for a tiny x, leaving -x: an update on-policy
    (logprobs recomputed a rounding away from the sampled ones) logged approx_kl -0.0 / tiny negatives."""
    import torch

    from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, Row

    old = [-0.01, -0.02, -0.005, -0.03]  # confident tokens
    logp = torch.nextafter(torch.tensor(old), torch.zeros(4))  # recomputed one float32 step above the sampled ones
    assert float((torch.exp(logp - torch.tensor(old)) - 1 - (logp - torch.tensor(old))).sum()) < 0  # the rounding
    row = Row(traj=0, node="n", adapter="a", prompt_ids=[1], completion_ids=[2, 3, 4, 5], old_logprobs=old,
              advantage=0.5, policy_version=0)
    totals: dict = {"clip": 0, "approx_kl": 0.0, "kl": 0.0, "pg": 0.0}
    FlowGRPO._token_loss(SimpleNamespace(config=FlowGRPOConfig()), row, logp, logp.clone(), totals)
    value = float(totals["approx_kl"])
    assert value >= 0 and math.copysign(1.0, value) == 1.0, value
