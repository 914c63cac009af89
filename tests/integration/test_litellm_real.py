"""The litellm backend against a real OpenAI-compatible server: `transformers serve` on the embedded model, in
its own process on a socket. The token counts it reports reach every trace, summary and index line, and they
are the real ones (the prompt's chat-template length, the output's length)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from masgraph.backends.base import Request
from masgraph.backends.litellm import LiteLLMBackend
from masgraph.cli import main
from masgraph.model import resolve_model
from masgraph.spec import SamplingSpec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(tmp_path_factory, free_port, wait_healthy):
    """`transformers serve <embedded model dir>`; yields (litellm model name, api base, model dir)."""
    model_dir = str(resolve_model("smollm2-135m"))
    log_path, port = tmp_path_factory.mktemp("tserve") / "server.log", free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen([exe, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
                                 "--default-seed", "0", "--device", "cpu"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 180, log_path.read_text)
    yield f"openai/{model_dir}", f"{url}/v1", model_dir
    proc.terminate()
    proc.wait(60)


def test_the_counts_recorded_are_the_servers_real_ones(served, run):
    from transformers import AutoTokenizer

    model, api_base, model_dir = served
    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [[{"role": "system", "content": "You are a calculator."},
              {"role": "user", "content": f"What is {i} * {i + 3}? Think step by step."}] for i in range(3)]
    limits = [6, 14, 64]
    out = run(LiteLLMBackend(model, api_base=api_base).complete(
        [Request(c, sampling=SamplingSpec(max_tokens=m)) for c, m in zip(chats, limits, strict=True)]))
    for chat, limit, c in zip(chats, limits, out, strict=True):
        assert c.prompt_tokens == len(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                              return_dict=False))
        assert 0 < c.completion_tokens <= limit and c.text
        if c.finish_reason == "length":
            assert c.completion_tokens == limit
        # re-tokenising the text may merge or split a token at the edges (and the stop token is not in the text)
        assert abs(c.completion_tokens - len(tok(c.text)["input_ids"])) <= 2
    assert [c.finish_reason for c in out[:2]] == ["length", "length"]


def test_a_yaml_graph_on_the_server_counts_its_tokens(served, tmp_path, capsys):
    """A user's own YAML graph whose policies are served by the server: the run's summary, traces and episode
    index all count the tokens (they read 0 before the usage was recorded)."""
    model, api_base, _ = served
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "graphs", "agentflow.yaml")) as f:
        spec = yaml.safe_load(f)
    for policy in spec["policies"].values():
        policy.update(backend="litellm", model=model, api_base=api_base, trainable=False)
        policy.pop("adapter", None)
    spec.pop("train", None)
    graph = tmp_path / "api.yaml"
    graph.write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    assert main(["run", str(graph), "--task", "basic_arithmetic", "--n", "3", "--runs-dir", str(runs)]) == 0
    assert "completion tokens 0.0" not in capsys.readouterr().out
    [run_dir] = runs.iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["completion_tokens_mean"] > 0
    index = [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]
    assert len(index) == 3 and all(e["tokens"] > 0 for e in index)
    assert sum(e["tokens"] for e in index) / 3 == pytest.approx(summary["completion_tokens_mean"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["kind"] == "step"]
    calls = [c for s in steps for c in s["llm"]]
    assert calls and all(c["completion_tokens"] > 0 and c["prompt_tokens"] > 0 and c["completion_ids"] == []
                         for c in calls)


def test_a_judge_served_through_litellm_records_the_servers_counts(served, tmp_path, run):
    """The judge on an API (litellm -> the real server): a verdict, its call with the server's token counts, cached
    on the second ask."""
    from masgraph.graph import compile_spec
    from masgraph.loader import load_spec
    from masgraph.runtime.engine import Engine
    from masgraph.tasks.judge import Judge, JudgeSpec

    model, api_base, _ = served
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    engine = Engine(compile_spec(load_spec(os.path.join(root, "graphs", "single.yaml")), check_models=False))
    spec = JudgeSpec.model_validate({"policy": {"backend": "litellm", "model": model, "api_base": api_base},
                                     "cache_path": str(tmp_path / "v.sqlite")})
    judge = Judge(engine.policy("judge", spec.policy), spec, engine.registry)
    assert ("litellm", model, api_base, "auto", "auto") in engine.backends  # its own backend beside the graph's
    v = run(judge.verdict("What is the capital of Peru?", ["Lima"], "Lima"))
    assert v.call is not None and v.call.text == v.text and v.score in (0.0, 1.0)
    assert v.call.prompt_tokens > 200 and 1 <= v.call.completion_tokens <= 4  # the server's counts (4: max_tokens)
    assert run(judge.verdict("What is the capital of Peru?", ["Lima"], "Lima")).cached
    judge.close()


@pytest.mark.slow
def test_a_local_trained_planner_with_api_served_fixed_nodes_trains_exports_and_serves(served, tmp_path, capsys,
                                                                                         free_port, wait_healthy):
    """AgentFlow's setting: the planner is a local LoRA policy that trains; the executor, verifier and generator
    are a fixed model behind an OpenAI-compatible API (litellm). Two training steps move only the planner's adapter;
    the run exports as a bundle that `masgraph serve` answers from, the fixed nodes still going to the API."""
    import httpx
    from safetensors.torch import load_file

    model, api_base, _ = served
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "graphs", "agentflow.yaml")) as f:
        spec = yaml.safe_load(f)
    for name in ("fixed", "verify"):
        spec["policies"][name] = {"backend": "litellm", "model": model, "api_base": api_base,
                                  "sampling": spec["policies"][name]["sampling"]}
    spec["train"] = {"task": "basic_arithmetic", "steps": 2, "queries_per_step": 1, "eval_every": 0, "eval_n": 2,
                     "checkpoint_every": 1, "flow_grpo": {"group_size": 4, "lr": 0.002, "temperature": 1.0,
                                                          "batching": {"zero_variance": "resample",
                                                                       "resample_rounds": 3}}}
    graph = tmp_path / "mixed.yaml"
    graph.write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    assert main(["train", str(graph), "--runs-dir", str(runs)]) == 0
    [run_dir] = [p for p in runs.iterdir() if p.is_dir()]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and any(r.get("rows/trained", 0) > 0 for r in rows), rows
    trained = load_file(run_dir / "checkpoints" / "step-2" / "adapters" / "planner" / "adapter_model.safetensors")
    lora_b = [v for k, v in trained.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # LoRA's B starts at zero: the updates moved it
    adapters = run_dir / "checkpoints" / "step-2" / "adapters"
    assert sorted(p.name for p in adapters.iterdir() if p.is_dir()) == ["planner"]  # nothing of the API's nodes
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    calls = [c for e in events if e["kind"] == "step" for c in e["step"]["llm"]]
    assert {c["policy"] for c in calls} == {"planner", "fixed", "verify"}
    assert all(c["completion_ids"] == [] for c in calls if c["policy"] != "planner")  # the API gives text, no ids

    bundle = tmp_path / "bundle"
    assert main(["export", str(run_dir), "--out", str(bundle)]) == 0
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "masgraph.cli", "serve", str(bundle), "--port", str(port),
                                 "--no-store"], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 180, log.read_text)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": "agentflow", "messages": [{"role": "user", "content": "What is 2 + 3?"}],
            "masgraph": {"trace": True}})
        assert r.status_code == 200, r.text
        body = r.json()
        ran = {s["node"] for s in body["masgraph"]["steps"] if s["error"] is None}
        assert {"planner", "executor", "generator"} <= ran and body["choices"][0]["message"]["content"], body
    finally:
        proc.terminate()
        proc.wait(60)
