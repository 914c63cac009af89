"""The weight dtype setting: `dtype:` per local policy (a located error for anything but auto, float32, bfloat16),
carried to the backend that runs the policy and to the learner, the local policies agreeing with each other and
with the checkpoint a run resumes from."""

from __future__ import annotations

import pytest
import torch

from masgraph.errors import SpecError
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.registry import default_registry
from masgraph.tasks import BasicArithmetic
from masgraph.trainers.loop import TrainLoop, base_dtype

GRAPH = """\
name: dt
policies:
  a: {{model: "{model}", adapter: plan, trainable: true, dtype: {a}}}
  b: {{model: "{model}", dtype: {b}}}
nodes:
  one: {{role: planner, policy: a}}
  two: {{role: generator, policy: b}}
edges:
  - {{source: one, target: two}}
entry: one
exit: two
train: {{task: basic_arithmetic, steps: 1, queries_per_step: 1, eval_every: 0}}
"""


@pytest.mark.parametrize("bad", ["int8", "fp16", "float16", "BF16", "''"])
def test_a_dtype_that_is_not_one_is_a_located_error(bad):
    with pytest.raises(SpecError) as err:
        parse_spec(GRAPH.format(model="smollm2-135m", a=bad, b="auto"), "dt.yaml")
    [problem] = err.value.problems
    assert problem.path == "policies.a.dtype" and "'auto', 'float32' or 'bfloat16'" in problem.message
    assert "dt.yaml:3:" in str(err.value)


def test_the_local_policies_pin_one_dtype_and_a_resumed_run_keeps_its_checkpoints():
    spec = lambda a, b: parse_spec(GRAPH.format(model="smollm2-135m", a=a, b=b), "dt.yaml")  # noqa: E731
    assert base_dtype(spec("auto", "auto")) == "auto"
    assert base_dtype(spec("auto", "bfloat16")) == "bfloat16" == base_dtype(spec("bfloat16", "bfloat16"))
    assert base_dtype(spec("auto", "auto"), "float32") == "float32"  # a checkpoint's, where nothing is pinned
    with pytest.raises(SpecError) as err:
        base_dtype(spec("float32", "bfloat16"))
    assert [p.path for p in err.value.problems] == ["policies.b.dtype"]
    assert "'bfloat16' differs from 'float32' of policy 'a'" in err.value.problems[0].message
    with pytest.raises(SpecError) as err:
        base_dtype(spec("bfloat16", "auto"), "float32")
    assert [p.path for p in err.value.problems] == ["policies.a.dtype"]
    assert "a resumed run's checkpoint" in err.value.problems[0].message


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_pinned_dtype_is_the_one_the_backend_and_the_learner_load(tiny, tmp_path, dtype):
    spec = parse_spec(GRAPH.format(model=tiny, a=dtype, b=dtype), "dt.yaml")
    backend = default_registry().backend(spec.policies["b"], {})
    assert backend.weights.dtype == getattr(torch, dtype)
    loop = TrainLoop(compile_spec(spec), BasicArithmetic(), tmp_path / "run")
    assert loop.learner.dtype == dtype
    base = {p.dtype for name, p in loop.learner.weights.model.named_parameters() if "lora_" not in name}
    assert base == {getattr(torch, dtype)}  # the adapters keep fp32 weights for the optimizer


class _Rank:
    """A learner rank's `DataParallel` as the agreement helpers use it: rank 0 writes; a broadcast records what this
    rank sent and returns `sent_by_0`, what rank 0 sent."""

    def __init__(self, rank: int, sent_by_0: str):
        self.writes, self.sent, self.sent_by_0 = rank == 0, [], sent_by_0

    def broadcast(self, obj, what):
        self.sent.append((obj, what))
        return self.sent_by_0


def test_learner_ranks_load_the_dtype_rank_0_measured(monkeypatch):
    """Under 2+ learner ranks an `auto` dtype is rank 0's choice, broadcast: a rank that measured for itself could
    choose otherwise on a busy machine (the ranks would then train different models). A checkpoint's or a pinned
    dtype needs no broadcast."""
    from masgraph.backends.hf import dtype as dtype_module
    from masgraph.cli.learners import agreed_dtype

    measured = []
    monkeypatch.setattr(dtype_module, "pick_dtype", lambda *, device=None: measured.append(device) or torch.float32)
    graph = compile_spec(parse_spec(GRAPH.format(model="smollm2-135m", a="auto", b="auto"), "dt.yaml"),
                         check_models=False)
    one, zero = _Rank(1, "bfloat16"), _Rank(0, "bfloat16")
    assert agreed_dtype(one, graph, "auto") == "bfloat16" and not measured  # rank 1 takes rank 0's, measures nothing
    assert agreed_dtype(zero, graph, "auto") == "bfloat16" and zero.sent == [("float32", "dtype broadcast")]
    assert agreed_dtype(None, graph, "auto") == "auto"  # one learner: the loop picks for itself
    assert agreed_dtype(one, graph, "float32") == "float32" and len(one.sent) == 1  # a checkpoint's
    pinned = compile_spec(parse_spec(GRAPH.format(model="smollm2-135m", a="float32", b="auto"), "dt.yaml"),
                          check_models=False)
    assert agreed_dtype(one, pinned, "auto") == "auto" and len(one.sent) == 1  # the loop takes the pin


def test_cpu_learner_ranks_run_the_linear_kernel_rank_0_chose(monkeypatch):
    """Likewise the fp32 linear kernel (`masgraph/backends/hf/onednn.py`): every CPU rank runs rank 0's, set before
    the model loads; a rank measuring for itself is never asked."""
    from masgraph.backends.hf import onednn
    from masgraph.cli.learners import agree_linear_kernel

    monkeypatch.setenv(onednn.ENV, "onednn")  # this rank's own choice; restored after the test
    onednn.kernel.cache_clear()
    cpu = GRAPH.format(model="smollm2-135m", a="auto", b="auto").replace("dtype: auto}", "dtype: auto, device: cpu}")
    graph = compile_spec(parse_spec(cpu, "dt.yaml"), check_models=False)
    try:
        zero, one = _Rank(0, "blas"), _Rank(1, "blas")
        agree_linear_kernel(one, graph)
        assert one.sent == [("", "linear kernel broadcast")] and onednn.kernel() == "blas"
        monkeypatch.setenv(onednn.ENV, "onednn")
        onednn.kernel.cache_clear()
        agree_linear_kernel(zero, graph)
        assert zero.sent == [("onednn", "linear kernel broadcast")] and onednn.kernel() == "blas"
        agree_linear_kernel(None, graph)  # one learner: nothing to agree on
    finally:
        onednn.kernel.cache_clear()
