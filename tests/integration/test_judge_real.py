"""The LLM judge on the embedded model (hf, in-process): a data task scored by it through a real run, its calls
recorded with their real token ids, its verdicts cached. (Through litellm against a real server:
tests/integration/test_litellm_real.py.)"""

from __future__ import annotations

import json

import pytest

from masgraph.cli import main
from masgraph.rundir.store import read_traces

pytestmark = pytest.mark.integration


def test_a_task_judged_by_the_embedded_model(tmp_path, root, capsys):
    items = [{"question": "What is the capital of Peru?", "answer": "Lima"},
             {"question": "How many moons does Mars have?", "answer": ["2", "two"]},
             {"question": "Who wrote Hamlet?", "answer": "William Shakespeare"}]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    cache = tmp_path / "verdicts.sqlite"
    (tmp_path / "qa.yaml").write_text(f"file: qa.jsonl\nscorer: judge\nsplit: test\njudge: {{cache_path: {cache}}}\n")
    args = ["run", str(root / "graphs" / "single.yaml"), "--task", f"data:{tmp_path / 'qa.yaml'}", "--n", "3",
            "--runs-dir", str(tmp_path / "runs"), "--deterministic"]
    assert main(args) == 0
    [run_dir] = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["episodes"] == 3 and summary["failures"]["error"] == 0
    judge = summary["judge"]
    assert (judge["verdicts"], judge["cached"], judge["calls"]) == (3, 0, 3)
    assert judge["prompt_tokens"] > 3 * 200  # the whole judge prompt, tokenised by the model
    traces = list(read_traces(run_dir))
    assert len(traces) == 3
    for t in traces:
        [call] = t.judge_calls
        assert call.policy == "judge" and call.temperature == 0.0
        assert len(call.prompt_ids) > 200 and len(call.completion_ids) == len(call.logprobs) >= 1
        assert t.meta["judge"]["verdict"] == call.text
        assert t.reward == t.meta["judge"]["score"] in (0.0, 1.0)
    capsys.readouterr()
    assert main(args) == 0  # a second run: every verdict from the cache, none called
    second = max((tmp_path / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    again = json.loads((second / "summary.json").read_text())["judge"]
    assert (again["verdicts"], again["cached"], again["calls"]) == (3, 3, 0)
    assert again != judge
