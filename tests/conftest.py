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


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default tiny model (addition), built once per cache."""
    from grpo_lab.tiny_model import tiny_model_path

    return tiny_model_path(progress=False)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir):
    from grpo_lab.tiny_model import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_dir)
