"""The trainers on two processes under `accelerate launch` (DDP over gloo, on the CPU): the same
step as one process, a run that learns, and `train-async` against a proxy, resumed under one
process (grpo_lab.train.distributed). accelerate's `--cpu` launcher starts one process, so the
launches use `--multi_gpu` (torchrun); the trainer then asks accelerate for CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from float_tolerance import assert_f32_close, f32_atol

from grpo_lab.proxy.config import start_proxy_process
from grpo_lab.serve.process import start_server_process
from grpo_lab.util.processes import free_port

HERE = Path(__file__).parent


def accelerate_launch(processes: int, *args: str) -> list[str]:
    """`accelerate launch` of `args` (a script, or `-m module ...`) on CPU processes."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()), *args]


# Set in this process by libraries the suite imports (TRL sets MASTER_ADDR and MASTER_PORT,
# accelerate RANK and WORLD_SIZE): a launched process group must rendezvous on its own.
LAUNCH_ENV_LEAKS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                    "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


def run(command: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV_LEAKS}
    # importing vLLM (through TRL) prepends opencv's bundled libraries to LD_LIBRARY_PATH: a
    # launched torch must load its own
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
        if p and "site-packages" not in p)
    # A process that dies of a signal prints its Python stacks (torchrun's summary says only
    # "Signal 6 received")
    env["PYTHONFAULTHANDLER"] = "1"
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode and GLOO_ABORT in result.stderr:
        # About 1 launch in 60 on 2 shared cores (once in CI, once in ~85 launches here), a
        # process aborts in C++ ("terminate called without an active exception") with no
        # Python error, even after a barrier and destroy_process_group: a CPU gloo flake of
        # torch's, not of the run. Launched again once, the run must then pass on its own.
        print("first launch aborted in C++ (torch's gloo on the CPU); launched once more:\n"
              + failure_lines(result.stderr))
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], failure_lines(result.stderr))
    return result


GLOO_ABORT = "Signal 6 (SIGABRT)"


CAUSES = ("Error", "error:", "terminate", "Fatal", "abort", "Signal", "Traceback", "File \"",
          "Thread 0x", "Current thread")


def failure_lines(stderr: str, most: int = 60) -> str:
    """The lines of a failed launch's stderr that say why (its tail is torchrun's summary and
    progress bars): tracebacks, C++ aborts and faulthandler's stacks, the last `most`."""
    lines = [line[:300] for line in stderr.splitlines() if any(c in line for c in CAUSES)]
    return "\n".join(lines[-most:]) or stderr[-4000:]


def test_two_processes_take_the_step_of_one(tiny_model_dir, tmp_path):
    """Same samples: each of 2 processes takes its prompts' rows (5 prompts: 3 and 2), and the
    step's loss and gradient equal one process's over the whole step, to float32 rounding, for
    both aggregations (GRPO in one pass; DAPO's token mean over token-budget micro-batches, whose
    count differs between the processes)."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    run([sys.executable, str(HERE / "distributed_step.py"), str(one)], timeout=300)
    run(accelerate_launch(2, str(HERE / "distributed_step.py"), str(two)), timeout=300)
    single, double = json.loads(one.read_text()), json.loads(two.read_text())
    assert (single["processes"], double["processes"]) == (1, 2)
    for trainer in ("sync", "async"):
        a, b = single[trainer], double[trainer]
        assert a["rows"] == 20 and b["rows"] == 12  # the main process's 3 of 5 prompts
        # Float32 rounding of sums in another order (two processes' shares, then DDP's mean):
        # tests/float_tolerance.py, with the step's sizes that distributed_step.py reports.
        assert (a["tokens"], a["positions"]) == (b["tokens"], b["positions"])
        assert a["layout"] == b["layout"] and a["layout"]["batch/samples_per_step"] == 20
        assert_f32_close(b["loss"], a["loss"], f32_atol(a["term_size"], a["tokens"]),
                         f"{trainer} loss")
        assert_f32_close(b["ratio"], a["ratio"], f32_atol(1.0, a["tokens"]), f"{trainer} ratio")
        assert a["grads"].keys() == b["grads"].keys() and len(a["grads"]) > 0
        largest = max(abs(x) for g in a["grads"].values() for x in g)
        assert largest > 1e-3  # a gradient worth comparing
        for name, grad in a["grads"].items():
            atol = f32_atol(max(abs(x) for x in grad), a["positions"])
            assert_f32_close(b["grads"][name], grad, atol, f"{trainer} {name}")


@pytest.mark.slow
def test_a_two_process_run_improves_held_out_accuracy(tiny_model_dir, tmp_path):
    """`grpo-lab train` on 2 processes: the main process alone writes, greedy accuracy rises."""
    out = tmp_path / "run"
    result = run(accelerate_launch(
        2, "-m", "grpo_lab.cli", "train", "--steps", "120", "--prompts-per-step", "16",
        "--eval-size", "256", "--eval-every", "0", "--progress", "false", "--log-every", "40",
        "--learning-rate", "2e-3", "--lr-scheduler-type", "linear", "--lora-rank", "4",
        "--temperature", "0.7", "--log-completions-every", "0", "--output-dir", str(out)),
        timeout=900)
    assert result.stdout.count("greedy accuracy by step") == 1  # printed by the main process
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(121))  # one line per step, no duplicate
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    # 256 held-out problems (64 left a 3-problem margin): measured +16 and +19 points, seeds 0, 1
    assert accuracy[-1] >= accuracy[0] + 0.05, accuracy
    assert (out / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow
def test_two_process_train_async_through_the_proxy_resumes_under_one(tiny_model_dir, tmp_path):
    """`train-async` on 2 processes against a proxy and one server: the main process alone
    publishes adapters and checkpoints; its checkpoint then resumes under one process."""
    out = tmp_path / "run"
    small = ["--prompts-per-step", "4", "--num-generations", "4", "--eval-size", "32",
             "--eval-every", "0", "--max-staleness", "1", "--progress", "false",
             "--checkpoint-every", "2", "--output-dir", str(out)]
    with start_server_process("tiny", enable_lora=True, max_lora_rank=1, max_loras=4,
                              logprobs_mode="processed_logprobs") as server, \
            start_proxy_process([server.url]) as proxy:
        args = ["-m", "grpo_lab.cli", "train-async", "--server-url", proxy.url, *small]
        first = run(accelerate_launch(2, *args, "--steps", "2"), timeout=600)
        assert first.stdout.count('"steps": 2') == 1  # one summary: the main process's
        syncs = [json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines()]
        assert [s["version"] for s in syncs] == [0, 1, 2]
        assert sorted(p.name for p in (out / "adapters" / "checkpoints").iterdir()) == \
            ["step-000002"]
        second = run([sys.executable, *args, "--steps", "4", "--resume"], timeout=600)
        assert "resuming from step-000002" in second.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == "step-000002"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert [s["version"] for s in
            (json.loads(line) for line in (out / "syncs.jsonl").read_text().splitlines())] == \
        [0, 1, 2, 3, 4, 5]
