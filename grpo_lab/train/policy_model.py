"""The policy the trainer starts from: which model `config.model` names, and how it is prepared
for training (LoRA on every linear layer, or full fine-tuning; activation checkpointing)."""

from __future__ import annotations

import warnings
from pathlib import Path

from ..model.models import MADE_MODELS, model_folder
from .config import GRPOConfig


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (transformers' "gradient
    checkpointing", renamed activation checkpointing in transformers 5); non-reentrant, so it
    works with a frozen base under a LoRA adapter."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def resolve_model_path(config: GRPOConfig):
    """A model as transformers loads it: grpo_lab's own by folder (grpo_lab.model.models), made
    first if needed; others as given."""
    folder = model_folder(config.model, task=config.task, difficulty=config.difficulty,
                          progress=config.progress)
    return Path(folder) if config.model in MADE_MODELS else config.model


def prepare_policy(model, config: GRPOConfig):
    """The model as the trainer trains it: in train mode, with activation checkpointing if asked,
    and wrapped in a rank-`lora_rank` LoRA adapter on every linear layer unless full fine-tuning."""
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if not config.use_lora:
        return model.train()
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft 0.21's PeftModel reads transformers' deprecated `is_gradient_checkpointing`
        # (peft/peft_model.py), which prints a FutureWarning in every run; grpo_lab itself
        # calls the new activation_checkpointing API. Only that message is hidden.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, lora).train()
