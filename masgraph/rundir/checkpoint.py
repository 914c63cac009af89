"""Checkpoint directories of a training run: find the newest complete one, read what it holds (state.json is
validated as `CheckpointState`; every adapter is a directory of the checkpoint itself)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from masgraph.errors import MasgraphError, one_of, shorten
from masgraph.rundir.layout import ADAPTERS, CHECKPOINTS, LATEST, STATE, STEP_DIR, TOPOLOGY_FILE
from masgraph.rundir.read import check_regular, parse_json

if TYPE_CHECKING:
    from masgraph.spec import GraphSpec


def has_learned_topology(checkpoint: Path | None) -> bool:
    """Whether a checkpoint holds a topology policy (it comes from `algorithm: hrpo` or `joint`)."""
    return checkpoint is not None and (checkpoint / TOPOLOGY_FILE).exists()
_USAGE = "pass a `masgraph train` run directory (its latest checkpoint) or RUN/checkpoints/step-N"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (half-written `.tmp` directories are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if STEP_DIR.fullmatch(name) and (root / name / STATE).is_file():
            return root / name
    done = [p for p in root.glob("step-*") if STEP_DIR.fullmatch(p.name) and (p / STATE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def checkpoint_states(run_dir: str | Path) -> list[dict[str, Any]]:
    """The state.json of every complete checkpoint of a run, each with its `path`, oldest step first; one being
    written or broken is left out, and a state.json that is not a regular file (a FIFO) is never opened."""
    found = []
    for d in (Path(run_dir) / CHECKPOINTS).glob("step-*"):
        if not STEP_DIR.fullmatch(d.name):
            continue
        try:
            check_regular(d / STATE)
            state = read_state(d)
        except MasgraphError:
            continue
        found.append(state | {"path": str(d)})
    return sorted(found, key=lambda s: s["step"])


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory (its latest) or a `.../checkpoints/step-N` path."""
    path = Path(path)
    if not path.exists():
        raise MasgraphError(f"checkpoint {path} does not exist; {_USAGE}")
    if not path.is_dir():
        raise MasgraphError(f"checkpoint {path} is a file, not a directory; {_USAGE}")
    if (path / STATE).is_file():
        return path
    if not (path / CHECKPOINTS).is_dir():
        raise MasgraphError(f"no complete checkpoint in {path}: it has no checkpoints/ directory; {_USAGE}")
    found = latest_checkpoint(path)
    if found is None:
        raise MasgraphError(f"no complete checkpoint in {path}/checkpoints (a step-N with a state.json); "
                            "the run was stopped before its first checkpoint: train it longer or pass another run")
    return found


Dtype = Literal["auto", "float32", "bfloat16", "float16"]
"""A weight dtype a learner loads (`auto`: the faster of bf16 and fp32 on this machine)."""
DTYPES: tuple[str, ...] = get_args(Dtype)
ANOTHER = "pass another step (RUN/checkpoints/step-N)"


def _directory_name(name: str) -> str:
    if name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError("not an adapter name (the name of a directory in adapters/)")
    return name


AdapterName = Annotated[str, Field(min_length=1, max_length=255), AfterValidator(_directory_name)]
"""An adapter of a checkpoint: the name of its directory in adapters/ (never a path that leads elsewhere)."""


class CheckpointState(BaseModel):
    """A checkpoint's state.json: the loop's position when it was written (trainers/checkpoints.py writes it)."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(ge=0)
    """Completed steps (the N of the checkpoint's step-N directory)."""
    cursor: int | None = Field(None, ge=0)
    """Next unused training item (None in checkpoints older than the cursor: step × queries_per_step)."""
    train_seconds: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Training time so far on the run's budget clock."""
    versions: dict[AdapterName, Annotated[int, Field(ge=0)]] = {}
    """Adapter -> its version (how many updates changed it)."""
    adapters: list[AdapterName]
    """The trained adapters saved in adapters/."""
    dtype: Dtype = "auto"
    """The learner's dtype (a resumed run keeps it)."""


State = TypeVar("State", bound=CheckpointState)


def load_state(checkpoint: Path, model: type[State] = CheckpointState) -> State:  # type: ignore[assignment]
    """A checkpoint's state.json as `model`, or a MasgraphError naming each bad field (and its value) with the fix.
    A state.json whose step is not its directory's (step-N) is refused too: it was copied from another step or
    run."""
    try:
        raw = parse_json((checkpoint / STATE).read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or UTF-8
        raise MasgraphError(f"checkpoint {checkpoint} has an unreadable state.json ({exc}); {ANOTHER}") from exc
    if not isinstance(raw, dict):
        raise MasgraphError(f"checkpoint {checkpoint}: state.json holds a {type(raw).__name__}, not a mapping; "
                            f"{ANOTHER}")
    try:
        state = model.model_validate(raw)
    except ValidationError as exc:
        raise MasgraphError(f"checkpoint {checkpoint}: state.json has "
                            f"{'; '.join(_problem(e) for e in exc.errors())}; {ANOTHER}") from None
    named = STEP_DIR.fullmatch(checkpoint.name)
    if named and int(named.group(1)) != state.step:
        raise MasgraphError(f"checkpoint {checkpoint}: state.json says step {state.step} but its directory is "
                            f"{checkpoint.name} (a state.json copied from another step or run); {ANOTHER}")
    return state


def _problem(error: Any) -> str:
    """One pydantic error as `field value (why)`, or `no `field``."""
    where = ".".join(str(x) for x in error["loc"])
    if error["type"] == "missing":
        return f"no `{where}`"
    why = error["msg"][:1].lower() + error["msg"][1:]
    return f"{where} {shorten(repr(error['input']))} ({why})"


def read_state(checkpoint: Path) -> dict[str, Any]:
    """A checkpoint's state.json (step, cursor, adapters, versions, dtype), validated (`load_state`)."""
    return load_state(checkpoint).model_dump()


def checkpoint_dtype(checkpoint: Path) -> str:
    """The dtype a checkpoint's run trained in (a resumed run keeps it; `auto` in checkpoints older than the field),
    or a MasgraphError naming the bad value before any model loads."""
    return load_state(checkpoint).dtype


def checkpoint_adapters(checkpoint: Path, spec: GraphSpec | None = None, folder: str = ADAPTERS) -> dict[str, Path]:
    """Adapter name -> its saved PEFT directory (in `folder`: adapters/, or behaviour/ for the next rollouts'), each
    checked to hold its config and weights and to be a directory of the checkpoint (not a link out of it). With the
    graph that will serve them (`spec`), also that they fit it: every adapter the graph trains is there, else its
    policies would answer with the untrained base model while the run says it serves trained adapters (the
    checkpoint of another graph)."""
    root = (checkpoint / folder).resolve()
    adapters = {name: checkpoint / folder / name for name in load_state(checkpoint).adapters}
    for name, path in adapters.items():
        if not path.resolve().is_relative_to(root):
            raise MasgraphError(f"checkpoint {checkpoint}: {folder}/{name} leads to {path.resolve()}, outside the "
                                f"checkpoint (a checkpoint's adapters are its own directories); {ANOTHER}")
        missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (path / f).is_file()]
        if missing:
            raise MasgraphError(f"checkpoint {checkpoint} is incomplete: adapter {name!r} lacks "
                                f"{', '.join(f'{folder}/{name}/{f}' for f in missing)}; {ANOTHER}")
    if spec is not None:
        lacking = set(spec.trainable_adapters().values()) - set(adapters)
        if lacking:
            raise MasgraphError(
                f"checkpoint {checkpoint} holds adapters {one_of(adapters)}, not {one_of(lacking)}, which graph "
                f"{spec.name!r} trains: those policies would answer untrained; pass a checkpoint of a training run "
                "of this graph")
    return adapters
