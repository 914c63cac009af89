"""RL trainers for masgraph graphs; installed as masgraph.trainers (a `masgraph.plugins` entry point)."""

if __name__ != "masgraph.trainers":  # the repo root is on sys.path (e.g. `python` started there)
    raise ImportError("this directory installs as `masgraph.trainers`; import that name instead of `trainers`")


def register(registry) -> None:
    """Entry point: the training algorithms (their `train:` section models, compile checks and implementations);
    one loop (`TrainLoop`) drives them all."""
    from masgraph.registry import Algorithm
    from masgraph.trainers.checks import flow_grpo_problems, joint_problems, topology_problems
    from masgraph.trainers.config import (
        DEFAULT_ALGORITHM,
        HRPOTrainSpec,
        JointTrainSpec,
        ReinforceTrainSpec,
        TrainSpec,
    )

    registry.algorithms["flow_grpo"] = Algorithm("flow_grpo", TrainSpec, flow_grpo_problems, train_loop,
                                                 lambda: _import("flow_grpo", "FlowGRPO"))
    registry.algorithms["hrpo"] = Algorithm("hrpo", HRPOTrainSpec, topology_problems, train_loop,
                                            lambda: _import("hrpo", "HRPO"))
    registry.algorithms["reinforce"] = Algorithm("reinforce", ReinforceTrainSpec, topology_problems, train_loop,
                                                 lambda: _import("reinforce", "Reinforce"))
    registry.algorithms["joint"] = Algorithm("joint", JointTrainSpec, joint_problems, train_loop,
                                             lambda: _import("joint", "Joint"))
    registry.default_algorithm = registry.default_algorithm or DEFAULT_ALGORITHM


def train_loop():
    """The loop class every registered algorithm runs in (imported on use: torch is not needed to validate)."""
    from masgraph.trainers.loop import TrainLoop

    return TrainLoop


def _import(module: str, name: str):
    import importlib

    return getattr(importlib.import_module(f"masgraph.trainers.{module}"), name)
