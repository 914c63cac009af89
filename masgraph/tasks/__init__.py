"""Tasks: deterministic items with disjoint train/test splits and a reward read from the trace.

`base` is the Task API and registry, `builtin` the built-in tasks, `load` finds a task by reference, `data` reads
tasks from data files (scored by `scorers` or an LLM `judge`); `arith` is the safe arithmetic parser both the
calculator tool and the scorers use.
"""

from masgraph.tasks.base import (
    CORRECT,
    MAX_ITEMS,
    TASKS,
    TEST_BUCKETS,
    Item,
    PartitionedTask,
    Task,
    TaskSplitWarning,
    _digest,
    as_number,
    full_reward,
    is_correct,
    is_test_question,
    numbers_equal,
    register_task,
    split_seed,
    task_ref,
)
from masgraph.tasks.builtin import (
    BasicArithmetic,
    ChainSum,
    Countdown,
    GsmSymbolic,
    LongArithmetic,
    Lookup,
    MemoryUpdates,
    MixedRoutes,
    MixedSkills,
    ReasoningGymTask,
    load_kb,
    make_kb,
)
from masgraph.tasks.load import get_task, load_task_file, resolve_task

__all__ = [
    "CORRECT", "MAX_ITEMS", "TASKS", "TEST_BUCKETS", "BasicArithmetic", "ChainSum", "Countdown", "GsmSymbolic",
    "Item", "LongArithmetic", "Lookup", "MemoryUpdates", "MixedRoutes", "MixedSkills", "PartitionedTask",
    "ReasoningGymTask", "Task", "TaskSplitWarning", "_digest", "as_number", "full_reward", "get_task", "is_correct",
    "is_test_question", "load_kb", "load_task_file", "make_kb", "numbers_equal", "register_task", "resolve_task",
    "split_seed", "task_ref",
]
