"""The optimizer of both trainers: AdamW with the reference's betas (0.9, 0.95) and no weight
decay (its TRL config's `adam_beta2=0.95`, `TrainingArguments`' weight decay 0), not torch's
defaults (0.999, 0.01). grpo_lab.train.trainer builds it; grpo_lab.trl.async_trainer maps the
same two fields onto TRL's config (tests/test_trl_async_job.py)."""

from __future__ import annotations

import pytest

from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer


def optimizer_defaults(model_dir, **fields) -> dict:
    model, tokenizer = load_model_and_tokenizer(model_dir)  # a fresh copy: LoRA wraps it
    return GRPOTrainer(GRPOConfig(steps=1, **fields), model=model,
                       tokenizer=tokenizer).optimizer.defaults


def test_grpo_lab_trainer_uses_the_reference_adamw(tiny_model_dir):
    defaults = optimizer_defaults(tiny_model_dir)
    assert (defaults["betas"], defaults["weight_decay"]) == ((0.9, 0.95), 0.0)
    custom = optimizer_defaults(tiny_model_dir, adam_beta2=0.999, weight_decay=0.01)
    assert (custom["betas"], custom["weight_decay"]) == ((0.9, 0.999), 0.01)
    with pytest.raises(ValueError, match="adam_beta2"):
        GRPOConfig(adam_beta2=1.0)
