"""RL trainers for masgraph graphs; installed as masgraph.trainers (a `masgraph.plugins` entry point)."""

if __name__ != "masgraph.trainers":  # the repo root is on sys.path (e.g. `python` started there)
    raise ImportError("this directory installs as `masgraph.trainers`; import that name instead of `trainers`")


def register(registry) -> None:
    """Entry point: the training algorithms (their `train:` section models, compile checks and trainers)."""
    from masgraph.registry import Algorithm
    from masgraph.trainers.checks import flow_grpo_problems, joint_problems, topology_problems
    from masgraph.trainers.config import DEFAULT_ALGORITHM, HRPOTrainSpec, JointTrainSpec, TrainSpec

    registry.algorithms["flow_grpo"] = Algorithm("flow_grpo", TrainSpec, flow_grpo_problems, _flow_grpo_trainer)
    registry.algorithms["hrpo"] = Algorithm("hrpo", HRPOTrainSpec, topology_problems, _flow_grpo_trainer)
    registry.algorithms["joint"] = Algorithm("joint", JointTrainSpec, joint_problems, _flow_grpo_trainer)
    registry.default_algorithm = registry.default_algorithm or DEFAULT_ALGORITHM


def _flow_grpo_trainer():  # one loop runs every algorithm (it asks the section which updates to make)
    from masgraph.trainers.loop import TrainLoop

    return TrainLoop
