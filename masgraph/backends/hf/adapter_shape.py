"""A saved LoRA adapter's shape, read without loading it: its rank, alpha and target modules (adapter_config.json)
and its weights' shapes (the safetensors header), and the check that it fits a model before anything is allocated:
an adapter made for another architecture, or one whose config claims an absurd rank, is a located MasgraphError
instead of a peft traceback or an allocation that takes the machine's memory."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from masgraph.backends.base import BackendError
from masgraph.errors import MasgraphError, shorten

__all__ = ["AdapterUnreadable", "LoraShape", "check_adapter_fits", "read_lora_shape", "weight_shapes"]


class AdapterUnreadable(BackendError):
    """An adapter directory whose config or safetensors header cannot be read, or is malformed."""

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"

MAX_CONFIG_BYTES = 1 << 20
"""Largest adapter_config.json read (peft writes ~1 kB)."""

MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header read (the safetensors format's own limit)."""


@dataclass(frozen=True)
class LoraShape:
    """What decides a LoRA adapter's parameters: its rank, alpha and target modules (a sorted list of names, or
    peft's one regex string), and per-module ranks where `rank_pattern` sets them."""

    rank: int
    alpha: float
    targets: list[str] | str
    rank_pattern: dict[str, int]

    @property
    def key(self) -> tuple[int, float, list[str] | str]:
        """(rank, alpha, targets): what a training run's `train:` section fixes."""
        return self.rank, self.alpha, self.targets


def read_lora_shape(path: str | Path) -> LoraShape:
    """The LoRA shape of the adapter directory `path` (its adapter_config.json), checked for type and range; a
    MasgraphError naming the file and the key otherwise."""
    file = Path(path) / CONFIG
    try:
        with open(file, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES} bytes")
        cfg = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:
        raise AdapterUnreadable(f"cannot read {file} ({shorten(str(exc), 200)})") from None
    if not isinstance(cfg, dict):
        raise AdapterUnreadable(f"{file} is not a JSON object")
    rank, alpha, targets = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("target_modules")
    if not _count(rank):
        raise AdapterUnreadable(f"{file}: `r` is {shorten(repr(rank))}, not a positive integer rank")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1e6:
        raise AdapterUnreadable(f"{file}: `lora_alpha` is {shorten(repr(alpha))}, not a positive number")
    if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, str) and t for t in targets):
        targets = sorted(targets)
    elif not (isinstance(targets, str) and targets):
        raise AdapterUnreadable(f"{file}: `target_modules` is {shorten(repr(targets))}, not a list of module names or "
                            "a regex")
    pattern = cfg.get("rank_pattern") or {}
    if not isinstance(pattern, dict) or not all(isinstance(k, str) and _count(v) for k, v in pattern.items()):
        raise AdapterUnreadable(f"{file}: `rank_pattern` is not a mapping of module names to positive integer ranks")
    return LoraShape(rank, alpha, targets, pattern)  # as written (32, not 32.0, in messages)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def weight_shapes(path: str | Path) -> dict[str, list[int]]:
    """{tensor name: shape} from the safetensors header of the adapter directory `path`'s weights, read without
    the tensors; a MasgraphError when the header is malformed or claims more bytes than the file holds."""
    file = Path(path) / WEIGHTS
    try:
        with open(file, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError, struct.error) as exc:
        raise AdapterUnreadable(f"cannot read the safetensors header of {file} ({shorten(str(exc), 200)})") from None
    shapes: dict[str, list[int]] = {}
    end = 0
    for name, info in header.items() if isinstance(header, dict) else ():
        if name == "__metadata__":
            continue
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if isinstance(info, dict) else (None, None)
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise AdapterUnreadable(f"{file}: tensor {shorten(name)!r} has a malformed header entry")
        shapes[name] = shape
        end = max(end, offsets[1])
    if not isinstance(header, dict) or end > size - 8 - n:
        raise AdapterUnreadable(f"{file}: its header claims {end} bytes of tensors, the file holds {size - 8 - n} "
                            "(truncated or forged)")
    return shapes


_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
"""A saved LoRA weight: `base_model.model.<module>.lora_A.weight` (peft drops the adapter name when saving)."""


def check_adapter_fits(name: str, path: str | Path, modules: Mapping[str, tuple[int, int]], model: str) -> LoraShape:
    """Check the saved adapter `name` at `path` against a model's linear layers (`modules`: full name -> (in
    features, out features)) before anything is allocated for it: every target module matches a layer of the model,
    its rank is at most each targeted layer's smaller side (a bigger one adds nothing and may not fit in memory),
    and every LoRA weight in the safetensors header is a weight of a targeted layer, of the shape that rank and that
    layer give. Returns the shape; a MasgraphError naming the adapter and the modules otherwise."""
    shape = read_lora_shape(path)
    where = f"adapter {name!r} ({path})"
    targeted = _targeted(shape.targets, modules)
    if isinstance(shape.targets, list):
        missing = [t for t in shape.targets if not any(_matches(t, m) for m in modules)]
        if missing:
            raise MasgraphError(f"{where} targets modules {missing} that model {model!r} does not have (its linear "
                                f"layers are named {_leaves(modules)}); it was trained for another architecture: "
                                "use an adapter trained on this model")
    if not targeted:
        raise MasgraphError(f"{where} targets {shape.targets!r}, which matches no linear layer of model {model!r} "
                            f"(named {_leaves(modules)}); use an adapter trained on this model")
    for module in targeted:
        rank = _rank_of(shape, module)
        side = min(modules[module])
        if rank > side:
            raise MasgraphError(f"{where}: rank {rank} is larger than module {module!r} of model {model!r} "
                                f"({modules[module][0]} x {modules[module][1]}), so at most {side}; its "
                                f"{CONFIG} is wrong (a LoRA rank is small: 8 to 64)")
    for key, dims in weight_shapes(path).items():
        hit = _LORA_KEY.match(key)
        if hit is None:
            continue
        module, part = hit["module"], hit["part"]
        if module not in modules:
            raise MasgraphError(f"{where}: its weights hold {key}, for module {module!r}, which model {model!r} "
                                "does not have; use an adapter trained on this model")
        if module not in targeted:
            raise BackendError(f"adapter checkpoint {path} does not match its own {CONFIG}: its weights hold {key}, "
                               f"for module {module!r}, which it does not target; fix: re-save the adapter, or use "
                               "another checkpoint")
        rank, (n_in, n_out) = _rank_of(shape, module), modules[module]
        want = [rank, n_in] if part == "A" else [n_out, rank]
        if dims != want:
            raise MasgraphError(f"{where}: {key} has shape {dims}, but rank {rank} on module {module!r} of model "
                                f"{model!r} makes it {want}; the adapter was saved for another model or rank")
    return shape


def _matches(target: str, module: str) -> bool:
    """peft's rule for a listed target: the module's full name, or a suffix of it at a dot."""
    return module == target or module.endswith("." + target)


def _targeted(targets: list[str] | str, modules: Mapping[str, tuple[int, int]]) -> list[str]:
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return [m for m in modules if m.rsplit(".", 1)[-1] not in ("lm_head", "embed_out")]
        try:
            rx = re.compile(targets)
        except re.error as exc:
            raise MasgraphError(f"target_modules {targets!r} is not a valid regex ({exc})") from None
        return [m for m in modules if rx.fullmatch(m)]
    return [m for m in modules if any(_matches(t, m) for t in targets)]


def _rank_of(shape: LoraShape, module: str) -> int:
    for key, rank in shape.rank_pattern.items():
        try:
            hit = _matches(key, module) or re.fullmatch(key, module) is not None
        except re.error:
            hit = False
        if hit:
            return rank
    return shape.rank


def _leaves(modules: Mapping[str, tuple[int, int]]) -> list[str]:
    """The distinct last parts of the module names (q_proj, ...), for a message."""
    return sorted({m.rsplit(".", 1)[-1] for m in modules})
