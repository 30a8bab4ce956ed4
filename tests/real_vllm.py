"""Tests that need real vLLM (its CPU build, `make vllm`): one gate for all of them.

Where vLLM is missing such a test skips with the reason (`vllm_missing_reason`), unless
GRPO_LAB_REQUIRE_VLLM=1 (as on CI), where it fails with that reason instead: a machine that was
meant to have vLLM cannot pass by skipping. Call `require_vllm()` first in the test, or in the
fixture that starts vLLM.
"""

from __future__ import annotations

import os

import pytest

from grpo_lab.serve.process import NO_VECTOR_KERNELS, vllm_missing_reason

REQUIRE_VLLM_ENV = "GRPO_LAB_REQUIRE_VLLM"


def vllm_required() -> bool:
    """GRPO_LAB_REQUIRE_VLLM=1: a missing vLLM fails the tests that need it."""
    return os.environ.get(REQUIRE_VLLM_ENV) == "1"


def require_vllm() -> None:
    """Return where real vLLM can run here; else skip with the reason, or fail under
    GRPO_LAB_REQUIRE_VLLM=1."""
    reason = vllm_missing_reason()
    if reason is None:
        return
    # Required means installed: an emulated processor that cannot run it (make test-machine
    # CPU_LEVEL=default) skips, as the learner's machine it stands for would.
    if vllm_required() and NO_VECTOR_KERNELS not in reason:
        pytest.fail(f"{reason} ({REQUIRE_VLLM_ENV}=1: run `make vllm` first)", pytrace=False)
    pytest.skip(reason)
