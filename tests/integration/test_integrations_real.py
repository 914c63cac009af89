"""`masgraph train` on the real model with an MCP tool in the loop and `--report-to tensorboard wandb`, wandb made
uninstallable: the episodes call the MCP server's tool (the trace holds the calls), one warning line names wandb,
the Flow-GRPO step trains (its group kept even without a reward signal), and TensorBoard's own reader finds every
metric of metrics.jsonl at its step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SERVER = '''
from mcp.server.mcpserver import MCPServer

mcp = MCPServer("adder", log_level="CRITICAL")

@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

if __name__ == "__main__":
    mcp.run()
'''

GRAPH = """\
name: mcp-train
policies:
  main: {{model: smollm2-135m, adapter: act, trainable: true, sampling: {{max_tokens: 16}}}}
tools:
  add: {{kind: mcp, timeout_s: 30, options: {{command: ["{python}", "{server}"], tool: add}}}}
nodes:
  act: {{role: executor, policy: main, tools: [add]}}
entry: act
exit: act
train:
  task: basic_arithmetic
  steps: 1
  queries_per_step: 1
  eval_every: 0
  eval_n: 1
  flow_grpo: {{group_size: 2, batching: {{zero_variance: keep}}}}
"""


def test_train_one_step_with_an_mcp_tool_reporting_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from masgraph.rundir.read import read_traces

    (tmp_path / "server.py").write_text(SERVER)
    (tmp_path / "graph.yaml").write_text(GRAPH.format(python=sys.executable, server=tmp_path / "server.py"))
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "wandb.py").write_text("raise ImportError('wandb is not installed (blocked by the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "masgraph.cli", "train", str(tmp_path / "graph.yaml"), "--report-to",
                        "tensorboard", "wandb", "--runs-dir", str(tmp_path / "runs")],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning: report_to")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: report_to wandb: could not start (ImportError")

    [run] = (tmp_path / "runs").iterdir()
    traces = list(read_traces(run / "events.jsonl"))
    assert len(traces) == 3  # the step's group of 2 and the held-out evaluation's 1
    for trace in traces:
        [step] = trace.steps
        assert step.tool.tool == "add" and step.tool.duration_s > 0 and step.tool.input
        assert (step.tool.output is None) != (step.tool.error is None)  # a result, or the reason it failed

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1]
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    expected = {(k, x["step"]): v for x in lines for k, v in x.items()
                if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)}
    assert {"reward/mean", "loss/total", "grad_norm/act"} <= {k for k, _ in expected}
    assert got == pytest.approx(expected, rel=1e-6)
