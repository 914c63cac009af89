"""benchmarks/memory.py's reference stores (the oracle and the one-rule arms) keep exactly the facts their rule says,
in stream order, on the task's own items."""

from __future__ import annotations

from masgraph.tasks import get_task


def test_each_reference_store_keeps_what_its_rule_says(memory_bench):
    bench, task = memory_bench, get_task("memory_updates")
    items = task.items("test", 12, seed=0)
    stores = {"oracle": bench.OracleStore(task)} | {n: bench.RuleStore(task, **r, name=n)
                                                     for n, r in bench.RULES.items()}
    kept = {n: s.items("test", 12, seed=0) for n, s in stores.items()}
    assert any(" visited " in it.question for it in items)
    for k, it in enumerate(items):
        *facts, question = it.question.splitlines()
        [move] = [f for f in facts if " moved to " in f]
        mover = move.split(" moved to ")[0]
        home = next(f for f in facts if f.startswith(mover + " lives in "))
        updated = [move if f == home else f for f in facts if f != move]
        got = {n: items_[k].question.splitlines() for n, items_ in kept.items()}
        for n, items_ in kept.items():
            assert got[n][-1] == question and items_[k].answer == it.answer, n
        assert got["skip_visits"][:-1] == [f for f in facts if " visited " not in f]
        assert got["update_moves"][:-1] == updated
        assert got["oracle"][:-1] == [f for f in updated if " lives in " in f or " moved to " in f]


def test_with_memory_changes_only_the_memory_node(memory_bench, root):
    """`--recall N` and the rule arms' modes edit the memory node and nothing else: every arm reads alike."""
    from masgraph.loader import load_spec

    spec = load_spec(root / "graphs" / "memory.yaml")
    edited = memory_bench.with_memory(spec, recall=1, mode="append")
    assert (edited.nodes["memory"].recall, edited.nodes["memory"].mode) == (1, "append")
    assert (spec.nodes["memory"].recall, spec.nodes["memory"].mode) == (2, "manager")  # the loaded spec is untouched
    assert edited.nodes["generator"] == spec.nodes["generator"] and edited.policies == spec.policies
    assert edited.nodes["memory"].model_dump(exclude={"recall", "mode"}) == \
        spec.nodes["memory"].model_dump(exclude={"recall", "mode"})
