"""benchmarks/gpu_smoke.py end to end on the CPU, small: every phase runs (bfloat16 GRPO, full and
LoRA; the server as a process; async GRPO over HTTP), its JSON holds them, and every mean ratio
is within 1e-2 of 1. On a GPU machine the same script runs with `--device cuda`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PHASES = {"sync_full", "sync_lora", "serve", "async_http", "real_shape"}


def bfloat16_dtype_here() -> str:
    """bfloat16, except on an emulated machine that no processor is: AMX tiles with torch's
    kernels held below AVX512 (`ATEN_CPU_CAPABILITY=avx2` on a Sapphire Rapids). There, bfloat16
    attention packs its operands for AMX with a kernel the lower level was built without
    ("pack_vnni2 is only supported when avx512 is supported"), so the run takes float32."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "float32" if amx and torch.backends.cpu.get_cpu_capability() != "AVX512" else \
        "bfloat16"


@pytest.mark.slow
def test_gpu_smoke_runs_every_phase_on_the_cpu(tiny_model_dir, tmp_path):
    out = tmp_path / "gpu_smoke.json"
    dtype = bfloat16_dtype_here()
    home = tiny_model_dir.parent.parent  # the tests' GRPO_LAB_HOME: the model is built there
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_smoke.py"), "--device", "cpu",
         "--steps", "2", "--prompts", "4", "--generations", "4", "--requests", "4",
         "--shape", "vocab-only", "--shape-new-tokens", "16",
         "--dtype", dtype, "--home", str(home), "--out", str(out)],
        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["passed"] and results["failures"] == []
    assert set(results["phases"]) == PHASES
    for name, phase in results["phases"].items():
        assert abs(phase["ratio_mean"] - 1) <= 1e-2, (name, phase)
        assert phase["peak_memory_bytes"] is None  # no GPU here
    for name in ("sync_full", "sync_lora", "async_http", "real_shape"):
        assert results["phases"][name]["steps"] == 2
    assert results["phases"]["real_shape"]["predicted_peak_bytes"] > 0
    serve = results["phases"]["serve"]
    assert (serve["server_device"], serve["server_dtype"]) == ("cpu", f"torch.{dtype}")
    assert serve["completions"] == 4 * 4 and serve["tokens"] > 0
    assert "async_http" in proc.stdout and "mean ratio" in proc.stdout
