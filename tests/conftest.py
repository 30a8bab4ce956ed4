"""Shared test set-up: an offline hub and one cache of built tiny models for the whole run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Built tiny models are cached per recipe; reusing the folder across runs saves ~50 s locally.
TEST_HOME = Path(os.environ.get("GRPO_LAB_TEST_HOME", REPO_ROOT / ".grpo_lab" / "test-home"))

# Set before any test imports transformers, and inherited by every subprocess and kernel.
os.environ["GRPO_LAB_HOME"] = str(TEST_HOME)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process: tests start servers, proxies and notebook kernels side by side,
# and two processes with torch's default thread count on 2 cores slow each other ~100x.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default tiny model (addition), built once per cache."""
    from grpo_lab.tiny_model import tiny_model_path

    return tiny_model_path(progress=False)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir):
    from grpo_lab.tiny_model import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def make_adapter(tiny_model_and_tokenizer):
    """Factory: write a random LoRA adapter of the tiny model (PEFT's files) into `path`.

    PEFT initialises B = 0 (the adapter starts as a no-op); random A and B make adapters that
    visibly change the model, and different seeds give different adapters.
    """

    def make(path, rank: int = 1, seed: int = 0, scale: float = 0.1):
        import copy

        import torch
        from peft import LoraConfig, get_peft_model

        base = copy.deepcopy(tiny_model_and_tokenizer[0])
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                            task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(path)
        return Path(path)

    return make
