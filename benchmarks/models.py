"""Models for the benchmarks: a name masgraph resolves (`smollm2-135m`, a local HF directory) or `random:SHAPE`,
a random-weight model of a real model's shape, built once into the cache.

Speed and memory do not depend on the weights' values, so a GPU machine without the real weights can still
measure them at the sizes that matter. The shapes are the published configs (Qwen2.5-0.5B / 1.5B, SmolLM2-135M,
vocabulary included), with the SmolLM2 tokenizer copied in (ids past its vocabulary decode to nothing). A random
model rarely says EOS, but may: the benchmarks make every call generate its full length on both sides compared
(`no_eos`, and `min_new_tokens` for `generate` and TRL), so both sides generate the same number of tokens.

    .venv/bin/python benchmarks/models.py random:qwen2-0.5b   # build it now; prints its directory
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from masgraph.files import building_dir
from masgraph.model import cache_dir

# The published configs (Qwen/Qwen2.5-0.5B, Qwen/Qwen2.5-1.5B, HuggingFaceTB/SmolLM2-135M-Instruct config.json);
# token ids are the SmolLM2 tokenizer's, which every random model here uses.
QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
         "max_position_embeddings": 32768, "tie_word_embeddings": True, "vocab_size": 151936,
         "attention_dropout": 0.0, "use_sliding_window": False}
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-0.5b": {**QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2-1.5b": {**QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2},
    "smollm2-135m": {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100_000.0,
                     "max_position_embeddings": 8192, "tie_word_embeddings": True, "vocab_size": 49152,
                     "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "head_dim": 64,
                     "num_attention_heads": 9, "num_key_value_heads": 3},
    # the smoke-test shape: seconds on a CPU (vocabulary = the tokenizer's, so it stays small)
    "tiny": {**QWEN2, "vocab_size": 49152, "max_position_embeddings": 8192, "hidden_size": 64,
             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
VERSION = "1"  # bump when a shape or the build changes: the cached directory is rebuilt


def tokenizer_dir() -> Path:
    """Where the SmolLM2 tokenizer files are: $MASGRAPH_BENCH_TOKENIZER, else the embedded model's converted
    directory in the cache (its tokenizer files are enough; the weights need not be there)."""
    return Path(os.environ.get("MASGRAPH_BENCH_TOKENIZER") or cache_dir() / "models" / "smollm2-135m-hf")


def is_random(name: str) -> bool:
    return name.startswith("random:")


def resolve(name: str, device: str = "cpu") -> str:
    """What to hand masgraph / transformers for `name`: `random:SHAPE` is built (once, on `device` when it is
    a GPU: faster) and its directory returned; any other name is returned as it is."""
    if not is_random(name):
        return name
    shape = name.removeprefix("random:")
    if shape not in SHAPES:
        raise SystemExit(f"--model {name}: unknown shape; use one of "
                         f"{', '.join('random:' + s for s in SHAPES)}, a model name or a local HF directory")
    return str(built(f"random-{shape}", SHAPES[shape], device))


def built(name: str, fields: dict[str, Any], device: str = "cpu") -> Path:
    """The cached directory of a random-weight model of config `fields` (`model_type` among them), with the SmolLM2
    tokenizer: built once, as `name`, on `device` when it is a GPU."""
    out = cache_dir() / "bench-models" / f"{name}-v{VERSION}"
    if (out / "model.safetensors").exists():
        return out
    return _build(name, fields, out, device)


def _build(name: str, fields: dict[str, Any], out: Path, device: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    src = tokenizer_dir()
    if not (src / "tokenizer.json").exists():
        raise SystemExit(f"the SmolLM2 tokenizer is not at {src}: copy its tokenizer files "
                         f"({', '.join(TOKENIZER_FILES)}) there, or point MASGRAPH_BENCH_TOKENIZER at a directory "
                         "holding them")
    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # the SmolLM2 tokenizer's
    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, **ids)
    print(f"building {name} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, vocab "
          f"{config.vocab_size}) into {out}", file=sys.stderr, flush=True)
    torch.manual_seed(0)
    build_on = torch.device(device if device.startswith("cuda") and torch.cuda.is_available() else "cpu")
    with build_on:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(**ids)
    try:
        with building_dir(out, prefix=f".{name}-") as tmp:
            model.save_pretrained(tmp)
            for f in TOKENIZER_FILES:
                if (src / f).exists():
                    shutil.copy(src / f, tmp / f)
    finally:  # the caller measures memory next: give the build's back
        del model
        if build_on.type == "cuda":
            torch.cuda.empty_cache()
    return out


def no_eos(*backends: Any) -> None:
    """Fixed-length generation on masgraph's hf backends: no token ends a completion, so every call runs to its
    `max_tokens` (the other side gets `min_new_tokens`). Only for random-weight models, where text means nothing."""
    for b in backends:
        layout = getattr(b, "layout", None)
        if layout is not None:
            layout.eos_ids.clear()


def params(path: str) -> int:
    """Parameter count of a model directory from its config (no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["random:tiny"]:
        path = resolve(arg)
        print(path, f"{params(path) / 1e6:.1f}M parameters")
