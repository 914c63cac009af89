"""Real episodes on SmolLM2-135M: every shipped graph, checked on the recorded tokens, not just on ending."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from masgraph.backends.base import Request
from masgraph.errors import ModelNotFoundError
from masgraph.graph import compile_spec
from masgraph.loader import load_spec
from masgraph.spec import SamplingSpec
from masgraph.tasks import get_task

pytestmark = pytest.mark.integration


def _check_call(hf, call, query):
    """Token-in/token-out: ids decode to the text; logprobs are the model's for exactly these ids."""
    ids = call.completion_ids
    assert ids and len(call.logprobs) == len(ids)
    assert hf.tokenizer.decode(ids, skip_special_tokens=True) == call.text
    assert all(math.isfinite(lp) and lp <= 0 for lp in call.logprobs)
    prompt = hf.tokenizer.decode(call.prompt_ids)
    assert query in prompt and prompt.endswith("<|im_start|>assistant\n")
    # teacher-forced forward over prompt_ids + completion_ids reproduces the recorded logprobs
    full = torch.tensor([call.prompt_ids + ids])
    ctx = hf.model.disable_adapter() if call.adapter is None and hf.model is not hf.base_model else _null()
    if call.adapter is not None:
        hf.model.set_adapter(call.adapter)
    with torch.inference_mode(), ctx:
        logp = torch.log_softmax(hf.model(full).logits[0].float(), -1)
    p = len(call.prompt_ids)
    ref = [float(logp[p - 1 + j, t]) for j, t in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(ref, call.logprobs)) < 2e-2


def _shown(trace, step, k: int) -> str:
    """What a call's prompt must hold: the query, or for a fact-store memory node its k-th fact and for the node it
    feeds the question (the query's last line), not the whole stream."""
    if step.memory_ops:
        return step.memory_ops[k].fact
    if trace.steps[0].memory_ops:
        return trace.query.splitlines()[-1]
    return trace.query


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("graph_name,task_name", [("agentflow", "basic_arithmetic"), ("agentflow", "lookup"),
                                                  ("single", "basic_arithmetic"), ("fanout", "basic_arithmetic"),
                                                  ("router", "basic_arithmetic"), ("mixed_router", "mixed_routes"),
                                                  ("memory", "memory_updates")])
def test_every_graph_runs_real_episodes(root, hf, runner_for, run, graph_name, task_name, graph_files):
    # a new graph needs a row
    assert {p.stem for p in graph_files} == {"agentflow", "single", "fanout", "router", "mixed_router", "memory"}
    graph = compile_spec(load_spec(root / "graphs" / f"{graph_name}.yaml"))
    n = 2 if graph_name == "memory" else 3  # a memory episode makes one checked call per fact of its stream (~10)
    result = run(runner_for(graph, hf, n=n, concurrency=n, split="test").run_task(get_task(task_name)))
    assert len(result.traces) == n and all(t.status == "ok" for t in result.traces), [t.error for t in result.traces]
    # a supergraph runs a sampled topology per episode (its untrained prior), recorded in the trace
    assert all((t.topology is not None) == (graph.spec.topology is not None) for t in result.traces)
    for tr in result.traces:
        assert tr.answer is not None and 0.0 <= tr.reward <= 1.0
        assert tr.steps[-1].node == graph.spec.exit
        assert tr.unused_steps == []  # no shipped graph drops an output (no `first` merge; no episode cut short)
        for step in tr.steps:
            for k, call in enumerate(step.llm):
                assert call.policy == graph.spec.nodes[step.node].policy
                assert call.adapter == graph.spec.policies[call.policy].adapter
                sampling = graph.spec.policies[call.policy].sampling
                assert (call.temperature, call.top_p) == (sampling.temperature, sampling.top_p)
                _check_call(hf, call, _shown(tr, step, k))
        if graph_name == "memory":  # one operation per fact, each from its own call
            facts = tr.query.splitlines()[:-1]
            assert [op.fact for op in tr.steps[0].memory_ops] == facts and len(tr.steps[0].llm) == len(facts)
    assert 0.0 <= result.summary["accuracy"] <= 1.0


def test_requests_from_concurrent_episodes_are_batched(root, hf, runner_for, run):
    graph = compile_spec(load_spec(root / "graphs" / "single.yaml"))
    before = dict(hf.stats)
    run(runner_for(graph, hf, n=8, concurrency=8).run_task(get_task("basic_arithmetic")))
    batches, rows = hf.stats["batches"] - before["batches"], hf.stats["rows"] - before["rows"]
    assert rows == 8 and batches <= 2


def test_deterministic_mode_reproduces_sampled_runs(root, hf, runner_for, run):
    spec = load_spec(root / "graphs" / "single.yaml")
    hot = spec.policies["main"].model_copy(update={"sampling": SamplingSpec(temperature=1.0, max_tokens=12)})
    graph = compile_spec(spec.model_copy(update={"policies": {"main": hot}}))
    hf.deterministic = True
    try:
        runs = [run(runner_for(graph, hf, n=4, concurrency=4, seed=11).run_task(get_task("basic_arithmetic")))
                for _ in range(2)]
    finally:
        hf.deterministic = False
    ids = [[t.llm_calls[0].completion_ids for t in sorted(r.traces, key=lambda t: t.episode_id)] for r in runs]
    assert ids[0] == ids[1]
    assert len({tuple(x) for x in ids[0]}) > 1  # per-request seeds differ across episodes


def test_named_adapters_share_one_base_and_mix_in_a_batch(hf, run):
    def base_tensors():  # peft renames wrapped layers' weights to *.base_layer.*
        return {k.replace(".base_layer", ""): v.detach().clone() for k, v in hf.base_model.state_dict().items()
                if "lora" not in k}

    base_before = base_tensors()
    for name in ("mix_a", "mix_b"):
        if name not in hf.versions:
            hf.add_adapter(name)
    with torch.no_grad():  # make mix_b do something
        for n, p in hf.model.named_parameters():
            if "lora_B" in n and "mix_b" in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    msgs = [{"role": "user", "content": "Name a color."}]
    reqs = [Request(msgs, adapter=a, sampling=SamplingSpec(max_tokens=8)) for a in (None, "mix_a", "mix_b")]
    mixed = hf.generate(reqs)
    alone = [hf.generate([r])[0] for r in reqs]
    assert [c.completion_ids for c in mixed] == [c.completion_ids for c in alone]
    assert mixed[0].completion_ids == mixed[1].completion_ids  # fresh adapter (B = 0) == base
    assert max(abs(a - b) for a, b in zip(mixed[0].logprobs, mixed[1].logprobs)) < 1e-4
    # the perturbed adapter changes what the model computes (first token's logprob, same prompt)
    assert abs(mixed[2].logprobs[0] - mixed[0].logprobs[0]) > 1e-2 or mixed[2].completion_ids != mixed[0].completion_ids
    after = base_tensors()
    assert after.keys() == base_before.keys() and all(torch.equal(base_before[k], after[k]) for k in base_before)


def test_overlong_prompt_is_truncated_not_crashed(hf, run):
    long = "word " * 5000
    [c] = run(hf.complete([Request([{"role": "user", "content": long + "\nSay hi."}],
                                   sampling=SamplingSpec(max_tokens=4))]))
    assert c.prompt_truncated and len(c.prompt_ids) <= hf.max_context - 4
    assert hf.tokenizer.decode(c.prompt_ids).endswith("<|im_start|>assistant\n")


def test_missing_model_is_a_clear_error():
    from masgraph.backends.hf import HFBackend

    with pytest.raises(ModelNotFoundError, match="never downloads"):
        HFBackend("/no/such/model")


def test_cli_run_end_to_end(root, tmp_path):
    env = {**os.environ, "PYTHONPATH": ""}
    out = subprocess.run([sys.executable, "-m", "masgraph.cli", "run", str(root / "graphs" / "single.yaml"),
                          "--task", "basic_arithmetic", "--n", "3", "--runs-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "accuracy" in out.stdout and "3/3" in out.stderr
    [run_dir] = tmp_path.iterdir()
    assert (run_dir / "events.jsonl").stat().st_size > 0 and (run_dir / "summary.json").exists()


def test_ctrl_c_stops_cleanly_and_keeps_finished_episodes(root, tmp_path):
    import json
    import signal
    import time

    from masgraph.rundir.store import read_traces

    proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "run", str(root / "graphs" / "single.yaml"),
                             "--task", "basic_arithmetic", "--n", "64", "--concurrency", "2",
                             "--runs-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            # a shell's background job starts its children with SIGINT ignored
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 240
    while time.time() < deadline:
        runs = list(tmp_path.iterdir())
        if runs and len(list(read_traces(runs[0]))) >= 2:
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    [run_dir] = tmp_path.iterdir()
    traces = list(read_traces(run_dir))
    assert sum(t.status == "ok" for t in traces) >= 2 and len(traces) < 64
    assert json.loads((run_dir / "summary.json").read_text())["interrupted"] is True
