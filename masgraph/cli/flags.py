"""Flag types of the `masgraph` command, and flags whose defaults are read from the config model they set."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return _whole_number(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def item_count(text: str) -> int:
    """argparse type of --n: a whole number from 1 to MAX_ITEMS (a task holds all its items in memory)."""
    from masgraph.tasks import MAX_ITEMS

    return _whole_number(text, 1, MAX_ITEMS)


def _whole_number(text: str, least: int, most: int | None = None) -> int:
    wanted = f">= {least}" if most is None else f"from {least} to {most:,}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number {wanted}, got {text!r}") from None
    if value < least or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"expected a whole number {wanted}, got {text!r}")
    return value


def field_default(source: Any, name: str) -> Any:
    """The default of `name` in `source`: a dataclass field, a pydantic model field, or a parameter of a function
    (or of a class's constructor)."""
    if dataclasses.is_dataclass(source):
        field = {f.name: f for f in dataclasses.fields(source)}[name]
        if field.default is not dataclasses.MISSING:
            return field.default
        if field.default_factory is not dataclasses.MISSING:
            return field.default_factory()
        raise ValueError(f"{source.__qualname__}.{name} has no default")
    fields = getattr(source, "model_fields", None)
    if isinstance(fields, dict):
        return fields[name].get_default(call_default_factory=True)
    default = inspect.signature(source).parameters[name].default
    if default is inspect.Parameter.empty:
        raise ValueError(f"{source.__qualname__}({name}=...) has no default")
    return default


def model_flag(p: argparse.ArgumentParser, flag: str, source: Any, field: str,
               to_flag: Callable[[Any], Any] | None = None, **kwargs: Any) -> argparse.Action:
    """Adds `flag` with the default of `source`'s `field` (converted by `to_flag`, e.g. bytes to KiB) instead of a
    literal; the action records where its default comes from (`action.model_default`) for the defaults test."""
    value = field_default(source, field)
    action = p.add_argument(flag, default=value if to_flag is None else to_flag(value), **kwargs)
    action.model_default = (source, field, to_flag)  # type: ignore[attr-defined]
    return action


def backend_args(p: argparse.ArgumentParser) -> None:
    """--backend, --api-base and --device (run, train)."""
    p.add_argument("--backend", help="serve every hf policy with this backend instead, e.g. vllm (a vLLM server: "
                   "started here unless --api-base; `make vllm` installs it)")
    p.add_argument("--api-base", help="with --backend vllm: attach to this running server (http://host:port/v1)")
    device_arg(p)


def device_arg(p: argparse.ArgumentParser) -> None:
    """--device (run, train, serve)."""
    p.add_argument("--device", help="where every hf policy's model runs: auto (the GPU when one is visible; the "
                   "default), cpu, cuda, cuda:N (overrides the policies' `device:`)")
