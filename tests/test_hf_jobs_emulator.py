"""The HF Jobs plan executed as submitted, on this machine (tests/hf_jobs_emulator.py): the real
`HfJobsLauncher` submits the exact plan of CPU flavors to a stand-in `run_job` that runs each
job's command (image aside) as a local process, with its env, its secrets, the bucket at its
mount path (read-only where the plan says so, whole-file writes only) and its port at a local
URL. It catches script errors, missing executables, wrong paths and forbidden writes before
anyone pays for a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from inspect import signature

import pytest
from hf_jobs_emulator import MOUNTS_ENV, HfJobsEmulator, run_job_keywords
from huggingface_hub import HfApi

from grpo_lab.launch.hf_jobs import HfJobsLauncher
from grpo_lab.launch.recipe_plan import RecipeConfig, recipe_plan
from grpo_lab.launch.specs import package_wheel_name, wheel_install
from grpo_lab.launch.trainer_args import default_trainer_args

TOKEN = "hf_emulated_token"
BUCKET_ID = "me/grpo-lora"
# What this machine's processes have that an image would bake in: grpo_lab importable (the
# install is swapped for `true`), no hub, no GPU, one thread per process.
HOST_ENV = {k: os.environ[k] for k in ("PYTHONPATH", "GRPO_LAB_HOME", "HF_HUB_OFFLINE",
                                       "CUDA_VISIBLE_DEVICES", "TOKENIZERS_PARALLELISM")
            if k in os.environ} | {"OMP_NUM_THREADS": "1"}


def test_the_emulator_takes_what_huggingface_hub_run_job_takes():
    """The installed release's keywords, in its order; the emulator also takes those that
    releases newer than grpo_lab's floor (huggingface_hub 1.24) added."""
    theirs = list(signature(HfApi.run_job).parameters)[1:]
    assert [k for k in run_job_keywords() if k in theirs] == theirs


def test_the_emulator_refuses_a_name_or_label_the_hub_refuses(tmp_path):
    """A job's name and labels are stored as tags: letters, digits, - and _ only. The plan's own
    names pass (RecipeConfig refuses a run name that would not)."""
    emulator = HfJobsEmulator(tmp_path / "hf")
    for name, labels in (("Blog.v1 run", None), ("blog", {"grpo-lab-run": "blog.v1"})):
        with pytest.raises(ValueError, match="the Hub refuses job"):
            emulator.run_job(image="python:3.11", command=["true"], name=name, labels=labels)
    with pytest.raises(ValueError, match="run name"):
        RecipeConfig(run_name="Blog.v1 run")


def test_the_emulated_mounts_refuse_what_a_bucket_mount_refuses(tmp_path):
    """In a job's Python processes: nothing written under a read-only mount; under a read-write
    one, whole files only, so the trainer's metrics logger, which appends a line every step,
    fails there on its second line (hence train-async --local-dir)."""
    emulator = HfJobsEmulator(tmp_path / "hf")
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    (ro / "adapter.bin").write_text("weights")
    script = textwrap.dedent(f"""
        import os, pathlib, shutil
        from grpo_lab.watch.metrics import MetricsLogger
        ro, rw = pathlib.Path({str(ro)!r}), pathlib.Path({str(rw)!r})
        def refused(action):
            try:
                action()
            except OSError:
                return True
            return False
        (rw / "summary.json").write_text("{{}}")          # a new file, written whole
        (rw / "summary.json").write_text('{{"a": 1}}')    # overwritten from the start
        shutil.copyfile(rw / "summary.json", rw / "copy.json")
        os.mkdir(rw / "policy-v1"); os.rename(rw / "policy-v1", rw / "policy-v2")
        logger = MetricsLogger(rw / "metrics.jsonl")
        logger.log({{"step": 1}})                          # creates the file: fine
        print(refused(lambda: logger.log({{"step": 2}})),  # appends to it: refused
              refused(lambda: open(rw / "summary.json", "r+").write("x")),
              refused(lambda: (ro / "new.txt").write_text("x")),
              refused(lambda: open(ro / "adapter.bin", "a")),
              refused(lambda: os.mkdir(ro / "d")),
              refused(lambda: os.rename(ro / "adapter.bin", ro / "moved.bin")),
              refused(lambda: shutil.rmtree(ro)),
              open(ro / "adapter.bin").read())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(emulator.site_dir),
                                                         os.environ.get("PYTHONPATH", "")]),
           MOUNTS_ENV: os.pathsep.join([f"{ro}=ro", f"{rw}=rw"])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 7 + ["weights"]
    assert (rw / "summary.json").read_text() == '{"a": 1}' and (rw / "policy-v2").is_dir()


@pytest.mark.slow
def test_the_hf_jobs_plan_trains_and_publishes_through_the_mount(tmp_path, tiny_model_dir):
    """Submit the HF Jobs plan (CPU flavors, the tiny model, a few steps) through the real
    launcher: replicas serve, the trainer job's proxy waits for them, the trainer trains and
    publishes adapters into the bucket, and the replicas load them from their read-only mount."""
    # The replicas' ports behind a stand-in of the jobs proxy: the HF token or 401, and the
    # header not forwarded (the recipe must not depend on it reaching a replica)
    emulator = HfJobsEmulator(tmp_path / "hf", host_env=HOST_ENV, jobs_proxy_token=TOKEN)
    with_token = {"Authorization": f"Bearer {TOKEN}"}
    mount = emulator.bucket_dir(BUCKET_ID)
    config = RecipeConfig(backend="hf-jobs", bucket=f"hf://buckets/{BUCKET_ID}",
                          mount_path=str(mount), base_model=str(tiny_model_dir), replicas=2,
                          max_staleness=1, replica_flavor="cpu-basic", trainer_flavor="cpu-basic",
                          run_name="emu", free_ports=True)
    steps = 4
    # The plan's own trainer arguments, then toy sizes (argparse keeps the last value of a flag)
    trainer_args = [*default_trainer_args("hf-jobs", gpu=False),
                    "--steps", str(steps), "--prompts-per-step", "4", "--num-generations", "4",
                    "--eval-size", "16", "--checkpoint-every", "2", "--log-completions-every", "2",
                    "--num-threads", "1", "--progress", "false",
                    "--local-dir", str(tmp_path / "trainer-local")]  # not /tmp: a shared host
    plan = recipe_plan(config, trainer_args=trainer_args)
    install = wheel_install(f"{mount}/emu/wheels/{package_wheel_name()}", image_has_torch=False)
    emulator.substitutions = {install: "true"}  # the only change: the venv has grpo_lab
    emulator.substituted = {install: 0}
    answered_first = []  # at the trainer's submission: did every replica answer /health?

    def run_job(**kwargs):
        if kwargs["name"].endswith("-trainer"):
            for url in launcher.urls.values():
                request = urllib.request.Request(f"{url}/health", headers=with_token)
                with urllib.request.urlopen(request, timeout=10) as r:
                    answered_first.append(r.status == 200)
        return emulator.run_job(**kwargs)

    with emulator:
        launcher = HfJobsLauncher(plan, run_job=run_job, cancel_job=emulator.cancel_job,
                                  upload=emulator.upload, exposed_url=emulator.exposed_url,
                                  environ={"HF_TOKEN": TOKEN}, inspect_job=emulator.inspect_job,
                                  poll_s=0.5)
        jobs = launcher.submit()
        assert answered_first == [True, True]  # the trainer waited for the replicas
        assert emulator.substituted == {install: 3}  # every job installs, as written
        assert (mount / "emu" / "wheels" / package_wheel_name()).is_file()  # uploaded first
        trainer = jobs["trainer"].id
        code = emulator.wait(trainer, timeout_s=300)
        assert code == 0, emulator.logs(trainer)[-4000:]
        assert "wait-healthy: http://127.0.0.1:" in emulator.logs(trainer)  # replicas first
        # The replicas, still serving, hold the last version, loaded from their mount
        summary = json.loads((mount / "emu" / "summary.json").read_text())
        for name in ("replica-0", "replica-1"):
            assert emulator.running(jobs[name].id), emulator.logs(jobs[name].id)[-3000:]
            request = urllib.request.Request(f"{launcher.urls[name]}/v1/models",
                                             headers=with_token)
            with urllib.request.urlopen(request, timeout=10) as r:
                served = {m["id"] for m in json.load(r)["data"]}
            assert f"policy-v{summary['version']}" in served, (name, served)
        launcher.cancel()

    # Everything the trainer job leaves in the bucket, written the way a mount takes it
    run = mount / "emu"
    assert summary["steps"] == steps and summary["version"] >= steps  # a sync every step
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics if "reward" in r] == list(range(1, steps + 1))
    syncs = [json.loads(line) for line in (run / "syncs.jsonl").read_text().splitlines()]
    assert [s["version"] for s in syncs] == list(range(summary["version"] + 1))
    assert (run / "completions.jsonl").is_file() and (run / "config.json").is_file()
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    published = sorted(p.name for p in (run / "adapters").glob("policy-v*"))
    assert f"policy-v{summary['version']}" in published
    assert (run / "adapters" / "checkpoints" / f"step-{steps:06d}" / "state.json").is_file()
