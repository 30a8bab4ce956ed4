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
