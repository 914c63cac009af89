"""The built-in tasks: reasoning-gym arithmetic, lookup, the mixed routing/skills tasks and memory updates."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from functools import cached_property, lru_cache
from importlib.resources import files
from typing import Any, ClassVar

from masgraph.tasks.base import (
    Item,
    PartitionedTask,
    is_test_question,
    numbers_equal,
    register_task,
    split_seed,
)


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
    needs routing (the designs that did not qualify: benchmarks/results/topology.md)."""

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
    """Where memory matters (Memory-R1): a stream of facts, one per line, the question last. Three people
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
