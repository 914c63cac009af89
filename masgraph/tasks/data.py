"""Tasks from your own data files, without writing a class: `--task data:PATH`.

PATH is a data file (`.json`: a list of objects; `.jsonl`: one object per line) read with the defaults below, or a
task file (`.yaml` / `.yml`) that says how to read one:

    name: bamboogle                       # default: the data file's stem (or its folder's, for data.json)
    file: ../shared/benchmarks/agentflow/bamboogle/data.json   # relative to the task file
    question: question                    # the field holding the question (default: question)
    answer: answer                        # the gold answer: a string, a number, or a list of alternatives
    scorer: contains                      # exact | contains | number | choice | game24 (masgraph/scorers.py) | judge
    judge:                                # with scorer: judge (masgraph/judge.py); all optional
      policy: {backend: litellm, model: openai/gpt-4o-mini}   # default: the embedded model, greedy
      cache: true                         # reuse verdicts for the same model and messages
    split: test                           # hash (default) | test | file (with test_file:)
    type: category                        # optional: a field whose value types each item (per-type metrics)

The split rule. `hash`: an item is held out when a hash of its question falls in the `test_fraction` (default 0.2)
share, so train and test never share a question whatever the seeds; a file too small for that share to be sure to
hit holds out at least one item per 1/test_fraction (one per five) all the same, and at least one: the items
whose hashes come next. Train items are shuffled by the seed, test items keep the file's order. `test`: every item
is held out (an evaluation set: `masgraph run` only; `masgraph train` refuses it before loading a model). `file`:
the items of `file` are the train split and those of `test_file` the test split, each in its file's order (train
shuffled by the seed). `--n N` takes the first N of a split; `DataTask.split_note` says what is held out.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from masgraph.errors import MasgraphError
from masgraph.tasks import Item, PartitionedTask, _digest, split_seed
from masgraph.tasks.judge import JudgeSpec
from masgraph.tasks.scorers import SCORERS, alternatives

__all__ = ["DataTask", "DataTaskSpec", "load_data_task"]

MAX_BYTES = 512 * 2**20
"""Largest data file read (512 MiB)."""


class DataTaskSpec(BaseModel):
    """How to read a task from a data file (a task file's fields)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str | None = None
    """The task's name in run directories and metrics (default: the data file's stem; its folder's name when the
    file is called data.json / data.jsonl)."""
    file: str
    """The data file (.json list or .jsonl), relative to the task file."""
    test_file: str | None = None
    """With `split: file`: the held-out items' file."""
    question: str = "question"
    """Field holding the question."""
    answer: str = "answer"
    """Field holding the gold answer (a list, or a string spelling a list, holds alternatives)."""
    scorer: Literal["exact", "contains", "number", "choice", "game24", "judge"] = "contains"
    """How an answer is scored: masgraph/scorers.py, or `judge`: an LLM judge (masgraph/judge.py, `judge:`)."""
    judge: JudgeSpec | None = None
    """With `scorer: judge`: the judging model, prompt and cache (default: the embedded model, greedy)."""
    split: Literal["hash", "test", "file"] = "hash"
    """hash: train/test by a hash of the question; test: every item held out; file: `file` trains, `test_file`
    tests."""
    test_fraction: float = Field(0.2, gt=0, lt=1)
    """With `split: hash`: the share of questions held out."""
    type: str | None = None
    """Optional field whose value types each item (`meta["type"]`: per-type rewards in training metrics)."""


class DataTask(PartitionedTask):
    """A task read from a data file as a `DataTaskSpec` says."""

    def __init__(self, spec: DataTaskSpec, base: Path):
        self.spec = spec
        file = Path(spec.file)  # AgentFlow's sets are each a data.json in a folder named after the set
        self.name = spec.name or (file.stem if file.stem != "data" else (base / file).resolve().parent.name)
        if spec.split == "file" and not spec.test_file:
            raise MasgraphError("split: file needs test_file: (the held-out items' file)")
        if spec.judge is not None and spec.scorer != "judge":
            raise MasgraphError(f"judge: is read only with scorer: judge (this task file says scorer: {spec.scorer})")
        self.judge = (spec.judge or JudgeSpec()) if spec.scorer == "judge" else None
        if spec.split != "file" and spec.test_file:
            raise MasgraphError(f"test_file: is read only with split: file (this task file says split: {spec.split})")
        self._train: list[Item] = []
        self._test: list[Item] = []
        records = _read(base / spec.file)
        items = [self._item(r, i, spec.file) for i, r in enumerate(records)]
        if spec.split == "file":
            self._train = items
            self._test = [self._item(r, i, spec.test_file) for i, r in enumerate(_read(base / spec.test_file))]
        elif spec.split == "test":
            self._test = items
        else:
            self._train, self._test = hash_split(items, spec.test_fraction)

    def _item(self, record: Any, index: int, file: str | None) -> Item:
        where = f"{file}: item {index + 1}"
        if not isinstance(record, dict):
            raise MasgraphError(f"{where} is a {type(record).__name__}, not an object with fields")
        for key, field in (("question", self.spec.question), ("answer", self.spec.answer)):
            if field not in record:
                raise MasgraphError(f"{where} has no field {field!r} (its fields: {', '.join(map(str, record))}); "
                                    f"name the right one with `{key}:` in a task file")
        question = str(record[self.spec.question])
        if not question.strip():
            raise MasgraphError(f"{where}: the question field {self.spec.question!r} is empty")
        gold = record[self.spec.answer]
        meta: dict[str, Any] = {"fields": record, "gold": alternatives(gold)}
        if self.spec.type is not None:
            meta["type"] = str(record.get(self.spec.type, ""))
        ident = str(record.get("pid", record.get("id", index)))
        return Item(f"{self.name}-{ident}", question, meta["gold"][0] if meta["gold"] else "", meta)

    @property
    def split_note(self) -> str:
        """What is held out, in words: '3 of 12 items held out (split: hash, ...)'."""
        held, total = len(self._test), len(self._test) + len(self._train)
        how = {"hash": f"by question hash, test_fraction {self.spec.test_fraction:g}; a small file still holds out "
                       f"1 in {round(1 / self.spec.test_fraction)}, at least 1",
               "test": "all of them: an evaluation set", "file": f"the items of {self.spec.test_file}"}[self.spec.split]
        return f"{held} of {total} items held out (split: {self.spec.split}, {how})"

    def generate(self, split: str, n: int, seed: int) -> list[Item]:
        if split == "test":
            return self._test[:n]
        if n and not self._train:
            fix = ("it is an evaluation set for `masgraph run`; to train on it, write a task file with split: hash (a "
                   "share held out by question hash) or split: file with a test_file:"
                   if self.spec.split == "test" else "add items (a file of 5 or more trains on 4 in 5 of them), or "
                   "give the train and test items in two files (a task file with split: file and test_file:)")
            raise MasgraphError(f"task {self.name!r} has no train items: {self.split_note}; {fix}")
        train = list(self._train)
        random.Random(split_seed(self.name, split, seed)).shuffle(train)
        return train[:n]

    def score(self, item: Item, answer: str) -> float:
        if self.judge is not None:
            raise MasgraphError(f"task {self.name!r} is scored by an LLM judge, which needs a model call: run it "
                                "through masgraph run / train (a Runner), or call masgraph.tasks.judge.Judge yourself")
        return SCORERS[self.spec.scorer](answer, item.meta["gold"], {**item.meta["fields"], "question": item.question})


def hash_split(items: list[Item], test_fraction: float) -> tuple[list[Item], list[Item]]:
    """(train, test) of `split: hash`: an item is held out when its question's hash falls in the `test_fraction`
    share; when fewer than max(1, ⌊N × test_fraction⌋) are (a small file), the items whose hashes come next are held
    out too, so a file of N ≥ 1 items always has held-out items. Both keep the file's order."""
    buckets = [_digest(it.question) % 10_000 for it in items]
    held = {i for i, b in enumerate(buckets) if b < test_fraction * 10_000}
    least = max(1, int(len(items) * test_fraction))
    if len(held) < least:
        nearest = sorted((i for i in range(len(items)) if i not in held), key=lambda i: (buckets[i], i))
        held.update(nearest[:least - len(held)])
    return ([it for i, it in enumerate(items) if i not in held], [it for i, it in enumerate(items) if i in held])


def _read(path: Path) -> list[Any]:
    """The records of a .json list or a .jsonl file; a located MasgraphError for anything else."""
    if not path.is_file():
        raise MasgraphError(f"data file {str(path)!r} does not exist" if not path.exists()
                            else f"{str(path)!r} is not a file")
    if path.stat().st_size > MAX_BYTES:
        raise MasgraphError(f"data file {path} is larger than {MAX_BYTES // 2**20} MiB")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MasgraphError(f"cannot read data file {path}: {exc}") from None
    if path.suffix == ".jsonl":
        records = []
        for k, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise MasgraphError(f"{path}:{k}: not a JSON object ({exc.msg}, column {exc.colno})") from None
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MasgraphError(f"{path}:{exc.lineno}:{exc.colno}: not JSON ({exc.msg}); a data file is a .json "
                                "list of objects or a .jsonl file") from None
        if not isinstance(records, list):
            raise MasgraphError(f"{path} holds a JSON {type(records).__name__}, not a list of items")
    if not records:
        raise MasgraphError(f"data file {path} holds no items")
    return records


def load_data_task(ref: str) -> DataTask:
    """The task `data:REF` names: a task file (.yaml/.yml) or a data file read with the defaults."""
    path = Path(ref)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise MasgraphError(f"task file {ref!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise MasgraphError(f"cannot read task file {ref}: {exc}") from None
        if not isinstance(raw, dict):
            raise MasgraphError(f"task file {ref} is not a mapping of fields (file:, question:, answer:, scorer:, "
                                "split:)")
        try:
            spec = DataTaskSpec.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            at = ".".join(map(str, err["loc"])) or "(top)"
            raise MasgraphError(f"{ref}: {at}: {err['msg']}") from None
        return DataTask(spec, path.parent)
    if path.suffix not in (".json", ".jsonl"):
        raise MasgraphError(f"data:{ref}: give a .json or .jsonl data file, or a .yaml task file that describes one")
    return DataTask(DataTaskSpec(file=path.name), path.parent)
