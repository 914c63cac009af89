"""One loaded transformers model with its tokenizer and named LoRA adapters: the weights an in-process learner
trains and hf backends serve (one object shared by both, never copied)."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch

from masgraph.backends.base import BackendError
from masgraph.backends.hf_dtype import pick_dtype
from masgraph.learner import LoraConfigSpec
from masgraph.model import resolve_model


class HFModel:
    """A causal LM and its LoRA adapters (a PEFT model once the first adapter is attached).

    Example:
        >>> weights = HFModel("smollm2-135m", dtype="float32")
        >>> weights.add_adapter("planner", LoraConfigSpec(rank=8))
        >>> with weights.use("planner"):
        ...     logits = weights.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    """

    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto", threads: int | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a 0.1 s load needs no bar; our own progress goes to stderr
        # peft calls a transformers API deprecated in 5.x; the warning is not actionable for users
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if threads:
            torch.set_num_threads(threads)
        path = resolve_model(model)
        self.name = model
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.dtype: torch.dtype = pick_dtype() if dtype == "auto" else getattr(torch, dtype)
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
        self.base_model = self.model

    def adapters(self) -> list[str]:
        return [] if self.model is self.base_model else list(self.model.peft_config)

    def add_adapter(self, name: str, lora: LoraConfigSpec | None = None) -> None:
        """Attach a fresh (zero-effect) LoRA adapter named `name` to the base model."""
        from peft import LoraConfig

        lora = lora or LoraConfigSpec()
        self._attach(name, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                                      lora_dropout=lora.dropout, task_type="CAUSAL_LM"))

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
        weight must load, else BackendError (and no adapter `name` is left attached)."""
        from peft import PeftConfig
        from safetensors.torch import load_file

        try:
            cfg = PeftConfig.from_pretrained(path)
            state = load_file(os.path.join(path, "adapter_model.safetensors"))
        except Exception as exc:  # missing file, bad JSON, truncated safetensors: several kinds
            raise BackendError(f"cannot read adapter checkpoint {path} ({type(exc).__name__}: {exc}); fix: point at "
                               "a directory saved by save_pretrained (adapter_config.json + "
                               "adapter_model.safetensors)") from None
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
        """Write `adapters` in PEFT format: `path/<name>/adapter_config.json + adapter_model.safetensors`."""
        self.model.save_pretrained(path, selected_adapters=adapters)

    def use(self, adapter: str | None) -> contextlib.AbstractContextManager:
        """Run the model under `adapter`, or with every adapter off (the base model) when it is None."""
        if self.model is self.base_model:
            return contextlib.nullcontext()
        if adapter is None:
            return self.model.disable_adapter()
        self.model.set_adapter(adapter)
        return contextlib.nullcontext()


def _lora_shape(cfg: Any) -> dict[str, Any]:
    """The parts of a PEFT config that decide an adapter's weights and output (not its bookkeeping fields)."""
    d = cfg.to_dict()
    keys = ("peft_type", "r", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "bias", "fan_in_fan_out",
            "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "exclude_modules")
    shape = {k: d.get(k) for k in keys}
    targets = d.get("target_modules")
    shape["target_modules"] = sorted(targets) if isinstance(targets, (list, set, tuple)) else targets
    return shape
