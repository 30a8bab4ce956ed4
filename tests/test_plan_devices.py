"""A local plan on a machine with GPUs: each job its own devices, or a share of one
(grpo_lab.launch.local). The GPUs are a count given to the functions, or torch's count
faked: nothing runs on a GPU here."""

from __future__ import annotations

import pytest
import torch

from grpo_lab.cli.main import main
from grpo_lab.launch.local import JobDevices, assign_devices, threads_per_process
from grpo_lab.launch.recipe_plan import recipe_plan


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `n` GPUs (the plan asks torch.cuda.device_count)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # conftest may set it: the plan's own

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return fake


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_no_gpu_leaves_every_job_on_the_cpu_with_one_thread(gpus, tmp_path):
    gpus(0)
    assert assign_devices(0, 2) == {}
    plan = recipe_plan(bucket=str(tmp_path), run_name="r")
    for name in ("replica-0", "replica-1", "trainer"):
        assert plan[name].env["OMP_NUM_THREADS"] == "1"
        assert "CUDA_VISIBLE_DEVICES" not in plan[name].env
    for name in ("replica-0", "replica-1"):
        assert flag(plan[name].command, "--num-threads") == "1"
        assert flag(plan[name].command, "--gpu-memory-utilization") is None
    assert plan["trainer"].command[1:4] == ["-m", "grpo_lab.cli", "train-async"]


def test_one_gpu_is_shared_with_headroom_for_the_trainer():
    devices = assign_devices(1, 2, gpu_memory_utilization=0.85)
    assert {name: d.gpus for name, d in devices.items()} == {
        "trainer": ("0",), "replica-0": ("0",), "replica-1": ("0",)}
    shares = [devices[f"replica-{i}"].memory_fraction for i in range(2)]
    assert shares == [0.21, 0.21]  # 0.85 x half the GPU / 2, rounded down
    assert sum(shares) <= 0.5  # the other half for the trainer (which has no cap)
    assert devices["trainer"].memory_fraction is None


def test_one_gpu_plan_gives_the_replicas_their_share(gpus, monkeypatch, tmp_path):
    gpus(1)
    # vLLM's GPU build
    monkeypatch.setattr("grpo_lab.launch.recipe_plan.vllm_is_cpu_build", lambda: False)
    plan = recipe_plan(bucket=str(tmp_path), run_name="r")
    for name in ("replica-0", "replica-1"):
        job = plan[name]
        assert job.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert flag(job.command, "--gpu-memory-utilization") == "0.21"
        assert flag(job.command, "--num-threads") is None  # on a GPU: torch's own threads
    assert plan["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0"
    vllm = recipe_plan(bucket=str(tmp_path), run_name="r", engine="vllm")
    assert flag(vllm["replica-0"].command, "--gpu-memory-utilization") == "0.21"
    assert vllm["replica-1"].env["CUDA_VISIBLE_DEVICES"] == "0"


def test_four_gpus_give_each_replica_its_own_and_the_trainer_two():
    devices = assign_devices(4, 2)
    assert devices == {"trainer": JobDevices(("0", "1")),
                       "replica-0": JobDevices(("2",), 0.85),
                       "replica-1": JobDevices(("3",), 0.85)}


def test_four_gpu_plan_runs_the_trainer_on_two_processes(gpus, tmp_path):
    gpus(4)
    plan = recipe_plan(bucket=str(tmp_path), run_name="r")
    assert [plan[n].env["CUDA_VISIBLE_DEVICES"] for n in ("replica-0", "replica-1", "trainer")] \
        == ["2", "3", "0,1"]
    trainer = plan["trainer"].command
    assert trainer[1:4] == ["-m", "accelerate.commands.accelerate_cli", "launch"]
    assert flag(trainer, "--num_processes") == "2" and "--use_fsdp" in trainer
    assert trainer[trainer.index("-m", 2):][:3] == ["-m", "grpo_lab.cli", "train-async"]
    assert "CUDA_VISIBLE_DEVICES" not in plan["proxy"].env
    threads = {plan[n].env["OMP_NUM_THREADS"] for n in ("replica-0", "replica-1", "trainer")}
    assert threads == {str(threads_per_process(4))}  # 2 replicas + 2 trainer processes


def test_eight_gpus_give_the_trainer_every_gpu_the_replicas_leave():
    devices = assign_devices(8, 2)
    assert devices["trainer"].gpus == tuple("012345")
    assert [devices[f"replica-{i}"] for i in range(2)] == [JobDevices(("6",), 0.85),
                                                          JobDevices(("7",), 0.85)]
    more = assign_devices(8, 7)  # one each, the trainer the last one left
    assert more["trainer"].gpus == ("0",) and {d.memory_fraction for d in more.values()} == {
        None, 0.85}


def test_fewer_gpus_than_jobs_keep_the_trainer_alone():
    devices = assign_devices(3, 4)
    assert devices["trainer"].gpus == ("0",)
    placed = [devices[f"replica-{i}"] for i in range(4)]
    assert [d.gpus for d in placed] == [("1",), ("2",), ("1",), ("2",)]
    assert {d.memory_fraction for d in placed} == {0.42}  # two per GPU: 0.85 / 2


def test_gpu_names_follow_cuda_visible_devices(gpus, monkeypatch, tmp_path):
    """The user's CUDA_VISIBLE_DEVICES picks the GPUs; the jobs name them as the machine does."""
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plan = recipe_plan(bucket=str(tmp_path), run_name="r", replicas=1)
    assert plan["trainer"].env["CUDA_VISIBLE_DEVICES"] == "5"
    assert plan["replica-0"].env["CUDA_VISIBLE_DEVICES"] == "7"
    assert "OMP_NUM_THREADS" not in plan["trainer"].env  # the user's own, inherited
    assert assign_devices(["GPU-a", "GPU-b"], 1)["replica-0"].gpus == ("GPU-b",)


def test_user_memory_budget_is_split_and_threads_share_the_cores():
    assert assign_devices(1, 2, gpu_memory_utilization=0.5)["replica-0"].memory_fraction == 0.12
    assert assign_devices(2, 1, gpu_memory_utilization=0.29)["replica-0"].memory_fraction == 0.29
    assert assign_devices(2, 2, gpu_memory_utilization=0.58)["replica-1"].memory_fraction == 0.29
    assert threads_per_process(3, cores=16) == 5 and threads_per_process(8, cores=2) == 1
    with pytest.raises(ValueError, match="cannot share"):
        assign_devices(1, 200)


def test_dry_run_shows_each_jobs_devices(gpus, tmp_path, capsys):
    gpus(1)
    assert main(["launch", "--dry-run", "--bucket", str(tmp_path), "--run-name", "r"]) == 0
    out = capsys.readouterr().out
    assert out.count("  gpus:    0 (memory share 0.21)") == 2  # the replicas
    assert out.count("  gpus:    0\n") == 1  # the trainer
    assert out.count("CUDA_VISIBLE_DEVICES=0 ") == 3  # the shell lines
