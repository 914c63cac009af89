"""The Task API: items with disjoint train/test splits, a reward read from the trace, and the task registry."""

from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, ClassVar

from masgraph.errors import MasgraphError
from masgraph.trace import Trace, full_reward


@dataclass(frozen=True)
class Item:
    """One task instance."""

    id: str
    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


class Task:
    """A verifiable task. Subclass it, set `name`, implement `generate` and `score`, and register it.
    `generate(split, ...)` gives each split its own questions (see `items` for the rule); for a fixed set of items
    used as they are, subclass `PartitionedTask`.

    Example:
        >>> @register_task
        ... class Echo(Task):
        ...     name = "echo"
        ...     def generate(self, split, n, seed):  # train and test must ask different questions
        ...         first = 0 if split == "train" else 1_000_000
        ...         return [Item(f"{split}-{i}", f"Repeat {first + i}", str(first + i)) for i in range(n)]
        ...     def score(self, item, answer):
        ...         return float(answer.strip() == item.answer)
    """

    name: ClassVar[str] = ""
    ref: str | None = None
    """The reference the task was loaded by when it is not `name` (`data:/abs/path.jsonl`, `/abs/file.py:Class`;
    set by `resolve_task`): what a run's config.json records, so `masgraph topology RUN` and a bundle's re-measure
    command load the same task again (see `task_ref`)."""
    judge: Any = None
    """A `masgraph.tasks.judge.JudgeSpec` when an LLM judge scores this task's answers (a data task's `scorer: judge`):
    runs then reward each episode by the judge's verdict instead of `score`. None: `score` does."""

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        raise NotImplementedError

    def score(self, item: Item, answer: str) -> float:
        raise NotImplementedError

    def items(self, split: str, n: int, seed: int = 0) -> list[Item]:
        """n items of a split ('train' | 'test').

        The split rule: train items are `generate("train", n, seed)` as they are. Test items are the first n of
        `generate("test", ...)` whose question is not among the first max(4n, 256) train questions, so a task
        whose splits overlap a little is still evaluated on questions it did not train on. A `generate` that
        ignores `split` gives the same questions for both: its first test items are all dropped, which is
        reported (a `TaskSplitWarning`; a `MasgraphError` when no test item is left) with the way out: keep the
        splits apart in `generate`, or subclass `PartitionedTask`, whose items are used exactly as `generate`
        returns them (the built-in tasks are disjoint by construction)."""
        _check_split(split)
        _check_n(n)
        if split == "train":
            return self.generate("train", n, seed)
        train_items = self.generate("train", max(4 * n, 256), seed)
        train = {it.question for it in train_items}
        kept: list[int] = []  # positions in `test` of the items used
        test: list[Item] = []
        k = n
        while len(kept) < n:
            k *= 2
            test = self.generate("test", k, seed)
            kept = [i for i, it in enumerate(test) if it.question not in train][:n]
            if k > 64 * n or len(test) < k:  # 64n asked for, or the task has no more
                break
        looked = kept[-1] + 1 if len(kept) == n and n else len(test)  # the test items gone through
        if len(kept) < looked:  # some were train items: say so, and what to do
            _report_dropped(self, n, seed, kept, looked, test, train_items)
        return [test[i] for i in kept]

    def reward(self, item: Item, trace: Trace) -> float:
        """Outcome reward in [0, 1]: the trace's final answer scored against the item."""
        return 0.0 if trace.answer is None else max(0.0, min(1.0, float(self.score(item, trace.answer))))

    def correct(self, item: Item, trace: Trace, reward: float | None = None) -> bool:
        """Whether the episode solved the item: the one definition of "correct" every accuracy counts (run,
        training evaluation, watch, benchmarks). Default: an episode that finished ok and scored the maximum
        reward (exact; partial credit is reward, not correctness). `reward`: the trace's reward, when computed."""
        if trace.status != "ok":
            return False
        return full_reward(self.reward(item, trace) if reward is None else reward)

    def probes(self, item: Item) -> list[Item]:
        """Further questions on `item`'s input, each an item of its own (id, question, answer) that `score`
        scores: what else a run's intermediate state should be able to answer. Counterfactual credit with
        `counterfactual_probes` scores each decision on them too, not only on the item's own question (a memory
        manager's choice about one person matters to a question about that person). Default: none."""
        return []


def task_ref(task: Task) -> str:
    """How to load `task` again with `resolve_task` (`--task`): its `ref`, else its registered `name`."""
    return task.ref or task.name or type(task).__name__


class TaskSplitWarning(UserWarning):
    """A task's test items were left out because they are also its train items (see `Task.items`)."""


def _report_dropped(task: Task, n: int, seed: int, kept: list[int], looked: int, test: list[Item],
                    train: list[Item]) -> None:
    """Says which test items `Task.items` left out and why, and what to do: a warning, or (none left) an error."""
    dropped = looked - len(kept)
    same = bool(test) and [it.question for it in test[:8]] == [it.question for it in train[:8]]
    why = (f"its generate() returns the same questions for 'train' and 'test' (it ignores `split`), so "
           f"{dropped} of its first {looked} test items are train items" if same else
           f"{dropped} of its first {looked} test items are also among its first {len(train)} train items")
    fix = ("keep the splits apart in generate() (e.g. test = every fifth item, train = the others), or, if its items "
           "are a fixed evaluation set, subclass masgraph.tasks.PartitionedTask instead of Task: its items are used "
           "exactly as generate(split, n, seed) returns them")
    name = task.name or type(task).__name__
    if not kept:
        raise MasgraphError(f"task {name!r} has no test items left (seed {seed}): {why}, and a test item that is "
                            f"also a train item is left out; {fix}")
    what = (f"only {len(kept)} of the {n} test items asked for are left" if len(kept) < n else
            f"the {n} test items used are generate('test', ...)'s #{kept[0]}..#{kept[-1]}, not its first {n}")
    warnings.warn(f"task {name!r} (seed {seed}): {why}; those were left out, and {what}. To use the items as "
                  f"generate() returns them: {fix}", TaskSplitWarning, stacklevel=3)


CORRECT = "correct"
"""The key of `Trace.meta` under which a run records the task's verdict (`Task.correct`) beside the reward."""


def is_correct(trace: Trace) -> bool:
    """Whether a finished episode counts as correct: its task's recorded verdict (`Trace.meta["correct"]`), else
    (a trace scored without one, e.g. from an older run) the default rule on its reward. Never for a failed one."""
    if trace.status != "ok":
        return False
    flag = trace.meta.get(CORRECT)
    return flag if isinstance(flag, bool) else full_reward(trace.reward)


_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|[+-]?\.\d+")


def as_number(text: str) -> Decimal | None:
    """`text` as an exact number when it is one (whitespace, a thousands separator and a trailing zero fraction
    allowed: "8.0", " 1,024 ", "-3"), else None; so "8.0" and "8" compare equal."""
    text = text.strip()
    if not _NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None


def numbers_equal(answer: str, gold: str) -> bool:
    """Whether both are numbers (`as_number`) and equal."""
    a, g = as_number(answer), as_number(gold)
    return a is not None and g is not None and a == g


TEST_BUCKETS = 5
"""A question is a test question when its hash falls in bucket 0 of TEST_BUCKETS (about 20 % of the item space)."""


def is_test_question(question: str) -> bool:
    """The fixed train/test partition of every built-in task's item space, by a hash of the question text."""
    return _digest(question) % TEST_BUCKETS == 0


def split_seed(task: str, split: str, seed: int) -> int:
    """The generator seed of one (task, split, seed): a hash, so different seeds give independent item streams."""
    return _digest(f"{task}|{split}|{seed}") % 2**30


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


MAX_ITEMS = 1_000_000
"""The most items one call of `Task.items` makes: they are all held in memory (and a reasoning-gym dataset is
sized 20n; an n past the platform's index size overflowed there)."""


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise MasgraphError(f"split must be 'train' or 'test', not {split!r}")


def _check_n(n: int) -> None:
    """A MasgraphError naming the allowed range unless 0 <= n <= MAX_ITEMS."""
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_ITEMS:
        raise MasgraphError(f"the number of items must be a whole number from 0 to {MAX_ITEMS:,}, not {n!r}")


class PartitionedTask(Task):
    """A task whose `generate` partitions the item space itself (reasoning-gym tasks by `is_test_question`), so
    no test question can ever be a train question, for any seeds."""

    def items(self, split: str, n: int, seed: int = 0) -> list[Item]:
        _check_split(split)
        _check_n(n)
        return self.generate(split, n, seed)


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if not cls.name:
        raise MasgraphError(f"task class {cls.__name__} needs a class attribute `name`")
    TASKS[cls.name] = cls
    return cls
