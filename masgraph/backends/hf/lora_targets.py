"""Which modules of a model get LoRA: the requested `lora_targets`, checked against (and fitted to) the modules the
architecture really has. Pure: it sees module names only, so it is tested without a model.

Most architectures people train agents with (Llama, Qwen2/3, Mistral, Gemma/Gemma2, Phi) name their attention
projections q_proj / k_proj / v_proj, the default targets. Others fuse them into one layer: Phi3's `qkv_proj`
(and its MLP's `gate_up_proj`), GPT-NeoX / Falcon's `query_key_value`, GPT-2's `c_attn`, MPT's `Wqkv`, Baichuan's
`W_pack`; there a q/k/v request means the fused layer. `all-linear` is peft's own shorthand for every linear layer
but the output head; it passes through to peft, which expands it when the adapter is attached (and writes the
expanded module list to adapter_config.json)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from masgraph.backends.base import BackendError

ALL_LINEAR = "all-linear"
"""peft's shorthand for every linear layer of the model except the output head."""

FUSED_ATTENTION = ("qkv_proj", "query_key_value", "c_attn", "Wqkv", "W_pack")
"""Single layers that project queries, keys and values together (Phi3, GPT-NeoX/Falcon, GPT-2, MPT, Baichuan)."""
ATTENTION_PARTS = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value"})
"""Requested names that a fused attention projection stands in for."""

FUSED_MLP = ("gate_up_proj",)
"""Single layers that compute an MLP's gate and up projections together (Phi3)."""
MLP_PARTS = frozenset({"gate_proj", "up_proj"})
"""Requested names that a fused gate/up projection stands in for."""


def resolve_targets(module_names: Iterable[str], requested: str | Sequence[str]) -> list[str] | str:
    """The `target_modules` to give peft for a LoRA on a model whose linear layers are `module_names` (full dotted
    names, e.g. `model.layers.0.self_attn.qkv_proj`, or bare ones), asked for as `requested`.

    `all-linear` (the string, or a list holding only it) is returned as the string. A requested name is used as
    given when a module is called it (its name equals it or ends with `.` + it: peft's matching). One the model
    lacks maps to the model's fused layer when it is part of one (q_proj/k_proj/v_proj -> qkv_proj, ...; gate_proj
    /up_proj -> gate_up_proj); any other is a BackendError that lists the model's linear module names and suggests
    `lora_targets: all-linear`. The result keeps the requested order, without duplicates.

    Example:
        >>> resolve_targets(["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"],
        ...                 ["q_proj", "v_proj"])
        ['qkv_proj']
    """
    names = list(module_names)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    if isinstance(requested, str):
        if requested.lower() == ALL_LINEAR:
            return ALL_LINEAR
        raise BackendError(f"LoRA targets {requested!r}: give a list of module names or {ALL_LINEAR!r}; this "
                           f"model's linear modules are {leaves}")
    requested = list(requested)
    if any(r.lower() == ALL_LINEAR for r in requested):
        if len(requested) == 1:
            return ALL_LINEAR
        raise BackendError(f"LoRA targets {requested}: {ALL_LINEAR!r} already means every linear layer; give it "
                           "alone (`lora_targets: all-linear`) or list module names without it")
    if not requested:
        raise BackendError(f"no LoRA targets given; fix: name some of this model's linear modules {leaves}, or "
                           f"`lora_targets: {ALL_LINEAR}`")

    def exists(target: str) -> bool:
        return any(n == target or n.endswith("." + target) for n in names)

    fused_attention = [f for f in FUSED_ATTENTION if exists(f)]
    fused_mlp = [f for f in FUSED_MLP if exists(f)]
    out: list[str] = []
    missing: list[str] = []
    for target in requested:
        if exists(target):
            chosen = [target]
        elif target in ATTENTION_PARTS and fused_attention:
            chosen = fused_attention
        elif target in MLP_PARTS and fused_mlp:
            chosen = fused_mlp
        else:
            missing.append(target)
            continue
        out += [c for c in chosen if c not in out]
    if missing:
        raise BackendError(f"LoRA targets {missing} are not modules of this model (its linear modules are {leaves}); "
                           f"fix: set the `train:` section's `lora_targets:` to some of those, or to `{ALL_LINEAR}` "
                           "(every linear layer but the output head)")
    return out
