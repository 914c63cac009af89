"""Tasks: deterministic items with disjoint train/test splits and a reward read from the trace."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
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

    Example:
        >>> @register_task
        ... class Echo(Task):
        ...     name = "echo"
        ...     def generate(self, split, n, seed):
        ...         return [Item(f"{split}-{i}", f"Repeat {i}", str(i)) for i in range(n)]
        ...     def score(self, item, answer):
        ...         return float(answer.strip() == item.answer)
    """

    name: ClassVar[str] = ""

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        raise NotImplementedError

    def score(self, item: Item, answer: str) -> float:
        raise NotImplementedError

    def items(self, split: str, n: int, seed: int = 0) -> list[Item]:
        """n items of a split ('train' | 'test'); test never repeats a train question."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        if split == "train":
            return self.generate("train", n, seed)
        train = {it.question for it in self.generate("train", max(4 * n, 256), seed)}
        out: list[Item] = []
        k = n
        while len(out) < n:
            k *= 2
            out = [it for it in self.generate("test", k, seed) if it.question not in train][:n]
            if k > 64 * n:
                break
        return out

    def reward(self, item: Item, trace: Trace) -> float:
        """Outcome reward in [0, 1]: the trace's final answer scored against the item."""
        return 0.0 if trace.answer is None else max(0.0, min(1.0, float(self.score(item, trace.answer))))


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name`")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise MasgraphError(f"unknown task {name!r}; built-in: {', '.join(sorted(TASKS))} (or FILE.py:ClassName)")
    return TASKS[name]()


def load_task_file(ref: str) -> Task:
    """A user Task subclass from `path/to/file.py:ClassName`."""
    import importlib.util

    path, _, cls_name = ref.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"masgraph_user_task_{Path(path).stem}", path)
    if not Path(path).is_file() or spec is None or spec.loader is None:
        raise MasgraphError(f"task file {path!r} not found (expected FILE.py:ClassName)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise MasgraphError(f"{ref}: {cls_name!r} is not a masgraph.tasks.Task subclass in {path}")
    return cls()


class ReasoningGymTask(Task):
    """A reasoning-gym dataset; splits use different seeds (test offset by 10_000) and are de-duplicated."""

    dataset: ClassVar[str] = ""
    config: ClassVar[dict[str, Any]] = {}

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        import reasoning_gym

        ds_seed = seed + (10_000 if split == "test" else 0)
        ds = reasoning_gym.create_dataset(self.dataset, size=n, seed=ds_seed, **self.config)
        return [Item(f"{self.name}-{split}-{ds_seed}-{i}", e["question"], str(e["answer"]), {"entry": e})
                for i, e in enumerate(ds)]

    def score(self, item: Item, answer: str) -> float:
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
class Lookup(Task):
    """Two-hop questions over the shipped knowledge base (masgraph/data/kb.jsonl): person -> city -> country."""

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
