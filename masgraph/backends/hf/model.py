"""One loaded transformers model with its tokenizer and named LoRA adapters: the weights an in-process learner
trains and hf backends serve (one object shared by both, never copied)."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from masgraph.backends.base import BackendError, LoraConfigSpec
from masgraph.backends.hf import cascade, onednn
from masgraph.backends.hf.dtype import pick_dtype
from masgraph.device import describe, is_out_of_memory, resolve_device
from masgraph.errors import MasgraphError
from masgraph.model import resolve_model
from masgraph.threads import hold_threads


class HFModel:
    """A causal LM and its LoRA adapters (a PEFT model once the first adapter is attached).

    Example:
        >>> weights = HFModel("smollm2-135m", dtype="float32")
        >>> weights.add_adapter("planner", LoraConfigSpec(rank=8))
        >>> with weights.use("planner"):
        ...     logits = weights.model(input_ids=torch.tensor([[1, 2, 3]], device=weights.device)).logits
    """

    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto", threads: int | None = None,
                 device: str = "auto"):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a 0.1 s load needs no bar; our own progress goes to stderr
        # peft calls a transformers API deprecated in 5.x; the warning is not actionable for users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if threads:  # the user's count, kept whatever the machine's load (masgraph/threads.py)
            torch.set_num_threads(threads)
            hold_threads()
        path = resolve_model(model)
        self.name = model
        self.device: torch.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.dtype: torch.dtype = pick_dtype(device=self.device) if dtype == "auto" else getattr(torch, dtype)
        try:  # SDPA (transformers' default where the architecture has it) runs FlashAttention kernels on a GPU
            self.model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        except Exception as exc:
            if is_out_of_memory(exc):
                raise BackendError(f"{model} does not fit on {describe(self.device)} in {self.dtype} ({exc}); fix: "
                                   "a smaller model, or another device (`--device cuda:N` with more free memory, "
                                   "or `--device cpu`)") from None
            raise
        self.head_hook = contiguous_head_input(self.model)
        """The hook that gives the output head a row-major input (removable: the rollout benchmark's arm without it)."""
        self.attention = cascade.install(self.model)
        """Whether the model runs under masgraph's attention (`cascade.NAME`: sdpa, masked grouped-query passes on a
        CPU on the key/value heads, and cascade decoding where a backend asks for it); its type allows it or not."""
        self.onednn_layers = onednn.install(self.model, self.dtype) if self.device.type == "cpu" else 0
        """Linear layers routed through oneDNN (`masgraph/backends/hf/onednn.py`; 0 where it gains nothing)."""
        self.base_model = self.model
        self.gradient_checkpointing = False
        self.full: dict[str, torch.Tensor] | None = None
        """Once sharded (`shard`): every LoRA parameter's whole tensor as of the last `gather` (what `save` writes and
        receivers get); None while the model is whole."""

    @property
    def max_positions(self) -> int | None:
        """The longest sequence the model was built for (its config's max_position_embeddings), if it says."""
        n = getattr(self.base_model.config, "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None

    def set_gradient_checkpointing(self, on: bool) -> None:
        """Recompute activations in the backward pass (less memory, ~30 % more compute); the learner's logprob
        pass then runs whole sequences, without the shared-prefix KV (a cache cannot be recomputed)."""
        if on == self.gradient_checkpointing:
            return
        model = self.base_model
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name for it
            enable, disable, key = (model.activation_checkpointing_enable, model.activation_checkpointing_disable,
                                    "activation_checkpointing_kwargs")
        else:
            enable, disable, key = (model.gradient_checkpointing_enable, model.gradient_checkpointing_disable,
                                    "gradient_checkpointing_kwargs")
        if on:
            enable(**{key: {"use_reentrant": False}})
        else:
            disable()
        self.gradient_checkpointing = on

    def adapters(self) -> list[str]:
        return [] if self.model is self.base_model else list(self.model.peft_config)

    @property
    def sharded(self) -> bool:
        """Whether the decoder layers are split across learner ranks (`shard`)."""
        return self.full is not None

    def shard(self, dp: Any) -> int:
        """Split the decoder layers (LoRA parameters with them) across the ranks of `dp` with FSDP2
        (`masgraph.learn.sharding`); a collective, on every rank, once its adapters are attached and before an
        optimizer holds their parameters (sharding replaces them). Returns the number of layers sharded."""
        from masgraph.learn.sharding import shard_layers

        if self.sharded:
            raise MasgraphError("the model is sharded already")
        layers, full = self._decoder_layers(), self._lora_tensors(whole=True)
        count = shard_layers(layers, dp)
        self.full = full  # only once sharded: a refused or failed shard leaves the model whole
        return count

    def gather(self) -> None:
        """Refresh `full` from the sharded LoRA parameters (a collective: every rank, after each optimizer step)."""
        if self.sharded:
            self.full = self._lora_tensors(whole=False)

    def _lora_tensors(self, whole: bool) -> dict[str, torch.Tensor]:
        from masgraph.learn.sharding import full_tensors

        named = [(n, p) for n, p in self.model.named_parameters() if "lora_" in n]
        return {n: p.detach().clone() for n, p in named} if whole else full_tensors(named)

    def _decoder_layers(self) -> list[torch.nn.Module]:
        """The backbone's repeated decoder blocks: `layers` (Llama, Qwen, Mistral, Phi, Gemma, ...) or `h` (GPT-2)."""
        from masgraph.backends.hf.logprobs import model_head

        backbone = model_head(self.model).backbone
        for name in ("layers", "h"):
            blocks = getattr(backbone, name, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
                return list(blocks)
        raise MasgraphError(f"cannot shard {type(backbone).__name__}: it has no `layers` or `h` list of decoder "
                            "blocks; fix: train without sharding (one device holds the whole base)")

    def refuse_if_sharded(self, what: str) -> None:
        """MasgraphError naming `what` when the model is sharded (only a whole model's adapters may change shape)."""
        if self.sharded:
            raise MasgraphError(f"cannot {what} once the model is sharded across learner ranks; fix: do it before "
                                "`shard` (every rank, the same way)")

    def add_adapter(self, name: str, lora: LoraConfigSpec | None = None) -> None:
        """Attach a fresh (zero-effect) LoRA adapter named `name` to the base model, on the modules
        `lora.target_modules` resolves to on this architecture (`resolve_targets`: e.g. Phi3's fused `qkv_proj` for
        q_proj/v_proj; `all-linear` as peft expands it); BackendError when the model has no such modules."""
        from peft import LoraConfig

        from masgraph.backends.hf.lora_targets import resolve_targets

        self.refuse_if_sharded(f"add adapter {name!r}")
        lora = lora or LoraConfigSpec()
        targets = resolve_targets(self._linear_module_names(), lora.target_modules)
        self._attach(name, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets,
                                      lora_dropout=lora.dropout, task_type="CAUSAL_LM"))

    def _linear_module_names(self) -> list[str]:
        """Full names of the base model's linear layers (what LoRA can target), also of those adapters wrap."""
        return list(self._linear_module_shapes())

    def _linear_module_shapes(self) -> dict[str, tuple[int, int]]:
        """The base model's linear layers (also those adapters wrap): full name -> (in features, out features)."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from transformers.pytorch_utils import Conv1D

        shapes: dict[str, tuple[int, int]] = {}
        inside = None  # the adapter-wrapped layer whose own modules (base_layer, lora_A, ...) come next (depth first)
        for module_name, module in self.base_model.named_modules():
            if inside is not None and module_name.startswith(inside):
                continue
            if isinstance(module, BaseTunerLayer):
                inside = module_name + "."
                module = module.get_base_layer()
            if isinstance(module, torch.nn.Linear):
                shapes[module_name] = (module.in_features, module.out_features)
            elif isinstance(module, Conv1D):  # GPT-2's: its weight is (in, out)
                shapes[module_name] = (module.weight.shape[0], module.weight.shape[1])
        return shapes

    def lora_targets(self, name: str) -> list[str] | str:
        """The modules adapter `name` targets as its adapter_config.json records them (sorted): what its
        `target_modules` resolved to on this model, `all-linear` expanded by peft."""
        targets = self.model.peft_config[name].target_modules
        return sorted(targets) if isinstance(targets, (list, set, tuple, frozenset)) else targets

    def _attach(self, name: str, cfg: Any) -> None:
        from peft import PeftModel, get_peft_model

        if isinstance(self.model, PeftModel):
            self.model.add_adapter(name, cfg)
        else:
            self.model = get_peft_model(self.base_model, cfg, adapter_name=name)
        self.model.eval()

    def delete_adapter(self, name: str) -> None:
        if name in self.adapters():
            self.model.delete_adapter(name)

    def load_adapter(self, name: str, path: str) -> None:
        """Load a saved PEFT adapter directory under `name`, in the LoRA shape it was saved with (its
        adapter_config.json). An existing adapter of that shape gets the weights in place (its parameter objects,
        which an optimizer may hold, stay); one of another shape is replaced by new parameters. Every LoRA
        weight must load, else BackendError (and no adapter `name` is left attached). Once sharded, only an
        existing adapter of the same shape loads (each rank keeps its shard), and a refused load changes nothing."""
        from masgraph.backends.hf.adapter_shape import AdapterUnreadable, check_adapter_fits

        if self.sharded:
            return self._load_sharded(name, path)
        try:  # against this model, before anything is allocated (an absurd rank would take the machine's memory)
            check_adapter_fits(name, path, self._linear_module_shapes(), self.name)
        except MasgraphError as exc:
            self.delete_adapter(name)  # as for weights that do not load: no adapter `name` is left
            if isinstance(exc, AdapterUnreadable):
                raise BackendError(f"cannot read adapter checkpoint {path} ({exc}); fix: point at a directory saved "
                                   "by save_pretrained (adapter_config.json + adapter_model.safetensors)") from None
            raise
        cfg, state = _read_adapter(path)
        existing = self.model.peft_config.get(name) if name in self.adapters() else None
        if existing is not None and _lora_shape(existing) != _lora_shape(cfg):
            self.model.delete_adapter(name)
            existing = None
        if existing is None:
            self._attach(name, cfg)
        try:
            self._load_weights(name, path, state)
        except BackendError:  # no half-loaded adapter stays
            self.model.delete_adapter(name)
            raise

    def _load_sharded(self, name: str, path: str) -> None:
        """`load_adapter` on a sharded model: every rank reads the whole tensors and keeps its shard of each (no
        collective); all of them are checked before any is written."""
        import re

        from masgraph.learn.sharding import shard_like

        existing = self.model.peft_config.get(name)
        cfg, state = _read_adapter(path)
        if existing is None or _lora_shape(existing) != _lora_shape(cfg):
            self.refuse_if_sharded(f"load adapter {name!r} in another LoRA shape than the attached one ({path})")
        # peft saves `...q_proj.lora_A.weight` for the parameter `...q_proj.lora_A.<name>.weight`
        mine = {re.sub(rf"\.(lora_\w+?)\.{re.escape(name)}\.", r".\1.", n): (n, p)
                for n, p in self.model.named_parameters() if "lora_" in n and f".{name}." in n}
        wrong = sorted(k for k in mine if k not in state or tuple(state[k].shape) != tuple(mine[k][1].shape))
        if wrong or state.keys() - mine.keys():
            raise BackendError(f"adapter checkpoint {path} does not fit adapter {name!r}: {len(wrong)} LoRA weights "
                               f"missing or of another shape (e.g. {wrong[:2]}), {len(state.keys() - mine.keys())} "
                               "unexpected; fix: re-save the adapter, or resume from an earlier checkpoint")
        with torch.no_grad():
            for key, (n, p) in mine.items():
                p.copy_(shard_like(state[key], p))
                self.full[n] = state[key].to(p.dtype).clone()

    def _load_weights(self, name: str, path: str, state: dict[str, torch.Tensor]) -> None:
        """Set adapter `name`'s weights from a saved state dict, strictly: no LoRA weight missing, no key unused."""
        from peft import set_peft_model_state_dict

        try:
            result = set_peft_model_state_dict(self.model, state, adapter_name=name)
        except RuntimeError as exc:  # size mismatch
            raise BackendError(f"adapter checkpoint {path} does not fit adapter {name!r}: {exc}") from None
        missing = [k for k in result.missing_keys if "lora_" in k and name in k.split(".")]
        if missing or result.unexpected_keys:
            raise BackendError(
                f"adapter checkpoint {path} does not match its own adapter_config.json: {len(missing)} LoRA weights "
                f"missing (e.g. {missing[:2]}), {len(result.unexpected_keys)} unexpected "
                f"(e.g. {result.unexpected_keys[:2]}); fix: re-save the adapter, or resume from an earlier checkpoint")

    def save(self, path: str, adapters: list[str]) -> None:
        """Write `adapters` in PEFT format: `path/<name>/adapter_config.json + adapter_model.safetensors` (once
        sharded: their whole tensors as of the last `gather`)."""
        self.model.save_pretrained(path, selected_adapters=adapters, state_dict=self.full)

    def use(self, adapter: str | None) -> contextlib.AbstractContextManager:
        """Run the model under `adapter`, or with every adapter off (the base model) when it is None."""
        if self.model is self.base_model:
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        self.model.set_adapter(adapter)
        return contextlib.nullcontext()


def contiguous_head_input(model: Any) -> Any:
    """Give `model`'s output head a row-major input. A decode pass asks for the last position's logits only
    (`logits_to_keep=1`), and transformers hands the head `hidden[:, -1:, :]`, a strided (B, 1, H) view; torch's
    `linear` cannot fold that into one matrix product and runs a batched one over the head's weight copied per row
    (pytorch/pytorch#151934, #186148): 872 vs 7 ms for 10 rows of SmolLM2-135M's 49k x 576 head in bf16 on a 2-core
    CPU. The copy of a (B, 1, H) input costs nothing beside that. Returns the hook's handle (None without a head)."""
    head = model.get_output_embeddings()
    if head is None:
        return None

    def pre_hook(module: torch.nn.Module, args: tuple) -> tuple | None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.stride() != _row_major(x.shape):  # size-1 dims' strides count too:
            return (x.clone(memory_format=torch.contiguous_format), *args[1:])  # `is_contiguous` ignores them
        return None

    return head.register_forward_pre_hook(pre_hook)


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _read_adapter(path: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """A saved PEFT directory's config and weights; BackendError with a fix when either cannot be read."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    try:
        return PeftConfig.from_pretrained(path), load_file(os.path.join(path, "adapter_model.safetensors"))
    except Exception as exc:  # missing file, bad JSON, truncated safetensors: several kinds
        raise BackendError(f"cannot read adapter checkpoint {path} ({type(exc).__name__}: {exc}); fix: point at "
                           "a directory saved by save_pretrained (adapter_config.json + "
                           "adapter_model.safetensors)") from None


def _lora_shape(cfg: Any) -> dict[str, Any]:
    """The parts of a PEFT config that decide an adapter's weights and output (not its bookkeeping fields)."""
    d = cfg.to_dict()
    keys = ("peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
            "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "exclude_modules")
    shape = {k: d.get(k) for k in keys}
    targets = d.get("target_modules")
    shape["target_modules"] = sorted(targets) if isinstance(targets, (list, set, tuple)) else targets
    return shape
