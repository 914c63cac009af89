"""Tasks: deterministic items with disjoint train/test splits and a reward read from the trace."""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
import unicodedata
import warnings
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from functools import cached_property, lru_cache
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar

from masgraph.errors import MasgraphError
from masgraph.trace import Trace


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
    judge: Any = None
    """A `masgraph.judge.JudgeSpec` when an LLM judge scores this task's answers (a data task's `scorer: judge`):
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


def full_reward(reward: float | None) -> bool:
    """The default correctness rule: the reward is the maximum (1.0)."""
    return reward is not None and reward >= 1.0


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


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise MasgraphError(f"unknown task {name!r}; built-in: {', '.join(sorted(TASKS))} (or FILE.py:ClassName, or "
                            "data:FILE.jsonl / data:TASK.yaml)")
    return TASKS[name]()


def resolve_task(ref: str) -> Task:
    """The task a `--task` / `train.task` value names: `data:PATH` (a data or task file, masgraph/datatask.py),
    `FILE.py:ClassName`, or a registered name."""
    if ref.startswith("data:"):
        from masgraph.datatask import load_data_task

        return load_data_task(ref.removeprefix("data:"))
    return load_task_file(ref) if ":" in ref else get_task(ref)


def load_task_file(ref: str) -> Task:
    """A user Task subclass from `path/to/file.py:ClassName`; every way it can fail is a MasgraphError."""
    import importlib.util

    path, _, cls_name = ref.rpartition(":")
    if not path or not cls_name:
        raise MasgraphError(f"task {ref!r}: expected FILE.py:ClassName, e.g. mytasks.py:MyTask")
    if not Path(path).is_file():
        raise MasgraphError(f"task file {path!r} not found; pass an existing FILE.py:ClassName")
    spec = importlib.util.spec_from_file_location(f"masgraph_user_task_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise MasgraphError(f"task file {path!r} is not a Python module; pass a .py file as FILE.py:ClassName")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look a class's module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the user's code: report where it failed, not our traceback
        del sys.modules[spec.name]
        raise MasgraphError(f"task file {path!r} failed to import: {type(exc).__name__}: {exc}{_where(exc, path)}; "
                            f"fix the file (run `python {path}` to see the full traceback)") from exc
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        what = ("it is not defined there" if cls is None else "it is not a class" if not isinstance(cls, type)
                else "the class does not subclass Task")
        found = [k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Task) and v is not Task]
        fix = f"name one of: {', '.join(found)}" if found else "subclass Task and implement generate() and score()"
        raise MasgraphError(f"{ref}: {cls_name!r} is not a masgraph.tasks.Task subclass in {path} ({what}); {fix}")
    try:
        return cls()
    except Exception as exc:
        raise MasgraphError(f"{ref}: {cls_name}() failed: {type(exc).__name__}: {exc}") from exc


def _where(exc: BaseException, path: str) -> str:
    """' (line N)' of the innermost traceback frame in the user's file, if any."""
    tb, line = exc.__traceback__, None
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename).resolve() == Path(path).resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None and isinstance(exc, SyntaxError) and exc.lineno:
        line = exc.lineno
    return f" (line {line})" if line else ""


class ReasoningGymTask(PartitionedTask):
    """A reasoning-gym dataset. Each (split, seed) reads its own stream (seeded by `split_seed`) and keeps the
    entries of its side of the `is_test_question` partition."""

    dataset: ClassVar[str] = ""
    config: ClassVar[dict[str, Any]] = {}

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        import reasoning_gym

        ds_seed = split_seed(self.name, split, seed)
        # entries are made on demand (entry i from Random(ds_seed + i)); the size only bounds the search
        ds = reasoning_gym.create_dataset(self.dataset, size=20 * n + 200, seed=ds_seed, **self.config)
        want_test = split == "test"
        out: list[Item] = []
        for i in range(len(ds)):
            entry = ds[i]
            if is_test_question(entry["question"]) == want_test:
                out.append(Item(f"{self.name}-{split}-{ds_seed}-{i}", entry["question"], str(entry["answer"]),
                                {"entry": entry}))
                if len(out) == n:
                    break
        return out

    def score(self, item: Item, answer: str) -> float:
        """reasoning-gym's score, except that a number equal to a numeric gold answer is full marks ("8.0" for 8:
        the gym's substring scorer gives it 1/3)."""
        if numbers_equal(answer, item.answer):
            return 1.0
        return float(self._scorer.score_answer(answer, item.meta["entry"]))

    @cached_property
    def _scorer(self) -> Any:
        import reasoning_gym

        return reasoning_gym.create_dataset(self.dataset, size=1, seed=0, **self.config)


@register_task
class BasicArithmetic(ReasoningGymTask):
    name = "basic_arithmetic"
    dataset = "basic_arithmetic"
    config = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


@register_task
class LongArithmetic(ReasoningGymTask):
    """basic_arithmetic with 4-6 terms of 2-3 digits: the planner must hand the whole expression to the
    calculator. The shipped agentflow graph is ~22 % greedy and ~38 % pass@8 (T=0.7) here: room to learn."""

    name = "long_arithmetic"
    dataset = "basic_arithmetic"
    config = {"min_terms": 4, "max_terms": 6, "min_digits": 2, "max_digits": 3}


@register_task
class ChainSum(ReasoningGymTask):
    name = "chain_sum"
    dataset = "chain_sum"
    config = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


@register_task
class Countdown(ReasoningGymTask):
    name = "countdown"
    dataset = "countdown"
    config = {"min_numbers": 3, "max_numbers": 4}


@register_task
class GsmSymbolic(ReasoningGymTask):
    name = "gsm_symbolic"
    dataset = "gsm_symbolic"


@register_task
class Lookup(PartitionedTask):
    """Two-hop questions over the shipped knowledge base (masgraph/data/kb.jsonl): person -> city -> country.
    Every fifth person is a test person; the KB has 150, so a test split holds at most 30 (seeds reorder them)."""

    name = "lookup"

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        people = load_kb()["people"]
        rng = random.Random(f"{seed}-{split}")
        pool = [p for i, p in enumerate(people) if (i % 5 == 0) == (split == "test")]
        rng.shuffle(pool)
        if split == "test":
            n = min(n, len(pool))  # test people are disjoint from train people; no repeats
        out = []
        for i in range(n):
            p = pool[i % len(pool)]
            out.append(Item(f"lookup-{split}-{seed}-{i}", f"In which country does {p['name']} live?",
                            p["country"], {"city": p["city"]}))
        return out

    def score(self, item: Item, answer: str) -> float:
        return float(re.sub(r"[^a-z]", "", item.answer.lower()) in re.sub(r"[^a-z]", "", answer.lower()))


@register_task
class MixedRoutes(PartitionedTask):
    """Three query types that need different routes through `graphs/router.yaml` (each item's `meta["type"]`):
    `arith` (basic arithmetic: a calculator helps), `city` (where a person of the shipped KB lives, one hop: only
    search knows), `compare` (the larger of two numbers: answerable directly, tools only cost tokens). The types
    alternate; train and test are disjoint (KB people split as in `lookup`, questions by `is_test_question`)."""

    name = "mixed_routes"
    TYPES = ("arith", "city", "compare")

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        k = -(-n // 3)
        arith = BasicArithmetic().generate(split, k, seed)
        rng = random.Random(split_seed(self.name, split, seed))
        city = [Item(f"{self.name}-{split}-{seed}-city-{i}", f"In which city does {p['name']} live?", p["city"])
                for i, p in enumerate(_kb_people(split, rng, k))]
        return _interleave(self.TYPES, (arith, city, _compare_items(self.name, split, seed, rng, k)))[:n]

    def score(self, item: Item, answer: str) -> float:
        kind = item.meta["type"]
        if kind == "arith":
            return BasicArithmetic().score(item, answer)
        if kind == "city":
            return float(re.sub(r"[^a-z]", "", item.answer.lower()) in re.sub(r"[^a-z]", "", answer.lower()))
        return _last_number_is(answer, item.answer)


def _compare_items(task: str, split: str, seed: int, rng: random.Random, k: int) -> list[Item]:
    """k questions "Which number is larger, a or b?" (a, b in 10..999) of `split` (by `is_test_question`)."""
    out: list[Item] = []
    while len(out) < k:
        a, b = rng.sample(range(10, 1000), 2)
        q = f"Which number is larger, {a} or {b}?"
        if is_test_question(q) == (split == "test"):
            out.append(Item(f"{task}-{split}-{seed}-compare-{len(out)}", q, str(max(a, b))))
    return out


def _last_number_is(answer: str, gold: str) -> float:
    """1.0 when the answer's last number (decimals read: "980.0" is 980) equals `gold`."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer)
    return float(bool(numbers) and numbers_equal(numbers[-1], gold))


@register_task
class MixedSkills(PartitionedTask):
    """A second mixed task whose three query types want three different tools (each item's `meta["type"]`):
    `country` (the country a city of the shipped KB is in: only search knows; the city's document names it),
    `letters` (how many letters a made-up word has: code counts them, a calculator cannot, a 135M model guesses),
    `power` ("Calculate 6^3 + 45.": the calculator reads `^` as a power, python as bitwise xor, so only the calculator
    route gets it right; the model alone cannot compute it). The types alternate; train and test are disjoint (every
    third KB city is held out; the other questions by `is_test_question`). benchmarks/topology_rule.py checks it
    needs routing. (Earlier designs did not qualify: a person's job, where the 135M generator answered the city; a
    product of two numbers, which python answers as well as the calculator; a real country's capital, which the
    supergraph's direct route answered with the country's own name; the larger of two numbers, which every route
    answers alike: RESULTS.md.)"""

    name = "mixed_skills"
    TYPES = ("country", "letters", "power")
    SYLLABLES = ("ka", "lo", "mi", "ra", "ten", "vor", "sa", "dul", "quen", "ix", "bra", "nol", "fe", "zan", "tor")

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        k = -(-n // 3)
        rng = random.Random(split_seed(self.name, split, seed))
        held_out = split == "test"
        cities = [d["facts"] for d in load_kb()["docs"] if d["id"].startswith("city-")]
        cities = [c for i, c in enumerate(cities) if (i % 3 == 0) == held_out]
        rng.shuffle(cities)
        countries = [Item(f"{self.name}-{split}-{seed}-country-{i}", f"Which country is {c['city']} in?",
                          c["country"]) for i, c in enumerate(cities[i % len(cities)] for i in range(k))]
        letters: list[Item] = []
        while len(letters) < k:
            word = "".join(rng.choice(self.SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize()
            q = f"How many letters are in the word {word}?"
            if is_test_question(q) == held_out:
                letters.append(Item(f"{self.name}-{split}-{seed}-letters-{len(letters)}", q, str(len(word))))
        power: list[Item] = []
        while len(power) < k:
            a, b, c = rng.randint(2, 9), rng.randint(2, 3), rng.randint(1, 99)
            q = f"Calculate {a}^{b} + {c}."
            if is_test_question(q) == held_out:
                power.append(Item(f"{self.name}-{split}-{seed}-power-{len(power)}", q, str(a ** b + c)))
        return _interleave(self.TYPES, (countries, letters, power))[:n]

    def score(self, item: Item, answer: str) -> float:
        """country: the name appears in the answer, accents and case aside; letters, power: the answer's last
        number is the gold one."""
        if item.meta["type"] == "country":
            return float(_letters_only(item.answer) in _letters_only(answer))
        return _last_number_is(answer, item.answer)


def _letters_only(text: str) -> str:
    """Lower-case ASCII letters of `text`, accents dropped ("Bogotá" -> "bogota")."""
    plain = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[^a-z]", "", plain.lower())


@register_task
class MemoryUpdates(PartitionedTask):
    """Where memory matters (issue 27, Memory-R1): a stream of facts, one per line, the question last. Three people
    of the shipped KB say where they live, one of them moves later ("X moved to Y."), most visit another city ("X
    visited Z last week."), and small talk fills the stream; the question asks where one of them lives now (two
    items in three: the one who moved). Read from a store of every line, the newest lines about a person are
    often the stale home or the visit; a store of the last few lines has lost the early ones; a manager that adds
    homes, updates the mover's entry and skips visits and small talk keeps only what is true. Correct: the answer
    names the person's current city and no other city of the stream. Train and test people are disjoint (every
    5th KB person is held out, as in `lookup`)."""

    name = "memory_updates"
    PEOPLE, SMALL_TALK, VISIT = 3, 2, 2 / 3
    TALK = ("It rained all afternoon.", "The train was late again.", "The library closes early on Fridays.",
            "A new bakery opened near the river.", "The football match ended in a draw.",
            "The old bridge is being painted.", "Tea prices went up this week.", "The town fair starts on Sunday.")

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        rng = random.Random(split_seed(self.name, split, seed))
        cities = sorted({p["city"] for p in load_kb()["people"]})
        out = []
        for i in range(n):
            people = _kb_people(split, rng, 40)
            people = [p for k, p in enumerate(people) if p["name"] not in {q["name"] for q in people[:k]}]
            people = people[:self.PEOPLE]
            mover = people[0]
            homes = {p["city"] for p in people}
            new_city = rng.choice([c for c in cities if c not in homes])
            lines = [f"{p['name']} lives in {p['city']}." for p in people]
            lines += rng.sample(self.TALK, self.SMALL_TALK)
            rng.shuffle(lines)
            after = lines.index(f"{mover['name']} lives in {mover['city']}.")
            lines.insert(rng.randint(after + 1, len(lines)), f"{mover['name']} moved to {new_city}.")
            visited = set()
            for p in people:
                if rng.random() < self.VISIT:
                    city = rng.choice([c for c in cities if c not in homes | {new_city}])
                    visited.add(city)
                    after = lines.index(f"{p['name']} lives in {p['city']}.")
                    lines.insert(rng.randint(after + 1, len(lines)), f"{p['name']} visited {city} last week.")
            asked = mover if i % 3 != 2 else rng.choice(people[1:])
            answer = new_city if asked is mover else asked["city"]
            stream = homes | {new_city} | visited
            question = f"Question: In which city does {asked['name']} live now?"
            out.append(Item(f"{self.name}-{split}-{seed}-{i}", "\n".join([*lines, question]), answer,
                            {"type": "moved" if asked is mover else "stayed", "others": sorted(stream - {answer})}))
        return out

    def score(self, item: Item, answer: str) -> float:
        def norm(s: str) -> str:
            return re.sub(r"[^a-z]", "", s.lower())

        said = norm(answer)
        return float(norm(item.answer) in said and not any(norm(c) in said for c in item.meta["others"]))

    def probes(self, item: Item) -> list[Item]:
        """The same stream asked where each of its other people lives now (their home, or the city they moved
        to), scored as the item is: naming that city and no other city of the stream."""
        *facts, question = item.question.splitlines()
        now: dict[str, str] = {}
        cities = set()
        for fact in facts:
            if m := re.fullmatch(r"(.+) (?:lives in|moved to) (.+)\.", fact):
                now[m.group(1)] = m.group(2)
            if m := re.fullmatch(r".+ (?:lives in|moved to|visited) (.+?)(?: last week)?\.", fact):
                cities.add(m.group(1))
        asked = re.fullmatch(r"Question: In which city does (.+) live now\?", question)
        out = []
        for k, (name, city) in enumerate(sorted(now.items())):
            if asked and name == asked.group(1):
                continue
            out.append(Item(f"{item.id}-probe-{k}", "\n".join([*facts, f"Question: In which city does {name} live "
                            "now?"]), city, {"type": "probe", "others": sorted(cities - {city})}))
        return out


def _kb_people(split: str, rng: random.Random, k: int) -> list[dict[str, Any]]:
    """k people of the shipped KB's `split` side (every 5th person is held out, as in `lookup`), shuffled by `rng`
    and repeated in that order when k is larger."""
    people = [p for i, p in enumerate(load_kb()["people"]) if (i % 5 == 0) == (split == "test")]
    rng.shuffle(people)
    return [people[i % len(people)] for i in range(k)]


def _interleave(types: tuple[str, ...], streams: tuple[list[Item], ...]) -> list[Item]:
    """One item of each stream in turn, each typed (`meta["type"]`) by its stream's name in `types`."""
    return [Item(it.id, it.question, it.answer, {**it.meta, "type": kind})
            for row in zip(*streams) for kind, it in zip(types, row)]


@lru_cache(maxsize=1)
def load_kb() -> dict[str, Any]:
    """The shipped knowledge base, read once per process (callers must not mutate it)."""
    docs = [json.loads(x) for x in (files("masgraph.data") / "kb.jsonl").read_text().splitlines() if x.strip()]
    people = [d["facts"] for d in docs if d["id"].startswith("person-")]
    return {"people": people, "docs": docs}


def make_kb(seed: int = 7, n_people: int = 150, n_cities: int = 30) -> list[dict[str, Any]]:
    """Generate the fictional knowledge base (deterministic; `python -m masgraph.tasks` rewrites kb.jsonl)."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ra", "ten", "vor", "sa", "dul", "quen", "ix", "bra", "nol", "fe", "zan", "tor", "wy"]

    def word(k: int) -> str:
        return "".join(rng.choice(syll) for _ in range(k)).capitalize()

    countries = sorted({word(3) for _ in range(12)})
    cities = sorted({word(2) + rng.choice(["ville", "burg", "port", "ford", "mere"]) for _ in range(n_cities)})
    city_country = {c: rng.choice(countries) for c in cities}
    docs = [{"id": f"city-{c.lower()}", "title": c, "text": f"{c} is a city in the country of {city_country[c]}.",
             "facts": {"city": c, "country": city_country[c]}} for c in cities]
    names = set()
    while len(names) < n_people:
        names.add(f"{word(2)} {word(2)}")
    jobs = ["baker", "pilot", "teacher", "weaver", "engineer", "doctor", "painter", "farmer"]
    for name in sorted(names):
        city = rng.choice(cities)
        job = rng.choice(jobs)
        docs.append({"id": f"person-{name.lower().replace(' ', '-')}", "title": name,
                     "text": f"{name} is a {job} who lives in {city}.",
                     "facts": {"name": name, "city": city, "country": city_country[city], "job": job}})
    return docs


if __name__ == "__main__":
    path = files("masgraph.data") / "kb.jsonl"
    with open(str(path), "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in make_kb())
    print(f"wrote {path}")
