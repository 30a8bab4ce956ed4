"""`--preset blog` against docs/recipe.md's table, the wheel through the bucket, several GPUs."""

from __future__ import annotations

import re
import shlex
import subprocess
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest
from launcher_helpers import BUCKET, TOKEN, FakeJobs, blog_plan, flag_values

from grpo_lab.cli.main import main
from grpo_lab.launch.hf_jobs import (
    HfJobsLauncher,
    build_package_wheel,
    hf_volume,
    upload_to_buckets,
)
from grpo_lab.launch.local import LaunchError
from grpo_lab.launch.recipe_config import BLOG_TRAINING, PRESETS
from grpo_lab.launch.recipe_plan import (
    preset_config,
    recipe_plan,
)
from grpo_lab.launch.specs import (
    PACKAGE_WHEEL,
    BucketMount,
    flavor_gpus,
    package_wheel_name,
)


def recipe_table() -> list[dict[str, str]]:
    """The rows of docs/recipe.md's table "The blog's run as `--preset blog`"."""
    text = (Path(__file__).parents[1] / "docs" / "recipe.md").read_text()
    section = text.split("### The blog's run as `--preset blog`", 1)[1].split("\n### ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip().strip("`") for c in line.strip("|").split("|"))))
            for line in lines[2:]]
    assert header == ["setting", "the blog (reference scripts)", "job", "flag", "value"] and rows
    return rows


def same_value(written: str, actual) -> bool:
    try:
        return float(written) == float(actual)
    except (TypeError, ValueError):
        return written == str(actual)


def test_preset_blog_matches_the_table_in_docs_recipe():
    """Every value of the table is what `--preset blog` passes, and every value the preset sets
    has its row."""
    config = preset_config("blog", bucket=BUCKET, run_name="blog")
    plan = recipe_plan(config)
    trainer = flag_values(shlex.split(plan["trainer"].command[2].splitlines()[-1]))
    replica = flag_values(plan["replica-0"].command)
    rows = recipe_table()
    launch = {"--" + f.replace("_", "-"): v for f, v in asdict(config).items()}
    for row in rows:
        flags = {"launch": launch, "trainer": trainer, "replicas": replica}[row["job"]]
        actual = flags[row["flag"]]
        assert same_value(row["value"], actual), (row, actual)
    flags = {(row["job"], row["flag"]) for row in rows}
    assert {("launch", "--" + f.replace("_", "-")) for f in PRESETS["blog"]} <= flags
    assert {("trainer", "--" + f.replace("_", "-")) for f in BLOG_TRAINING} <= flags
    assert [job.flavor for job in plan.jobs] == ["h200", "h200", "h200x2"]


def test_preset_blog_dry_run_prints_bash_that_calls_python3(capsys):
    """`grpo-lab launch --backend hf-jobs --preset blog --dry-run`: no bucket needed; every
    command passes `bash -n` and calls `python3`, never `python`; a flag replaces the preset's."""
    assert main(["launch", "--backend", "hf-jobs", "--preset", "blog", "--dry-run",
                 "--run-name", "blog"]) == 0
    out = capsys.readouterr().out
    lines = out.split("\n\n", 1)[1]  # after the plan: the `hf jobs run` lines
    checked = subprocess.run(["bash", "-n", "-c", lines], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert out.count("hf jobs run --detach") == 3 and "vllm serve Qwen/Qwen2.5-Math-1.5B" in out
    assert "--learning-rate 4e-05" in out and "--device cuda" in out
    # The h200x2 trainer: one process per GPU under `accelerate launch`, FSDP2 (issue 27).
    trainer_line = next(line for line in out.splitlines()
                        if line.startswith("exec ") and "train-async" in line)
    assert trainer_line.startswith("exec accelerate launch --use_fsdp --fsdp_version 2 ")
    assert "--num_processes 2 -m grpo_lab.cli train-async --model Qwen/Qwen2.5-Math-1.5B" \
        in trainer_line
    plan = recipe_plan(preset_config("blog", bucket="hf://buckets/x/y", run_name="blog"))
    for job in plan.jobs:
        text = job.command[2] if job.command[:2] == ["bash", "-c"] else shlex.join(job.command)
        assert subprocess.run(["bash", "-n", "-c", text]).returncode == 0, job.name
        assert not re.search(r"(^|[\s;&|(`])python(\s|$)", text), (job.name, text)
    assert "python3 -m grpo_lab.launch.local wait-healthy" in plan["trainer"].command[2]
    assert main(["launch", "--preset", "blog", "--replicas", "3", "--dry-run"]) == 0
    assert capsys.readouterr().out.count("hf jobs run --detach") == 4
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("blogg")


def test_hf_jobs_a_failed_upload_submits_nothing():
    fake = FakeJobs()

    def upload(uploads, token=None):
        raise RuntimeError("403 Forbidden")

    with pytest.raises(LaunchError, match="403 Forbidden.*no job was submitted"):
        HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=upload,
                       environ={"HF_TOKEN": TOKEN}).submit()
    assert fake.calls == []


def test_the_wheel_ships_the_package_and_goes_to_the_named_bucket(tmp_path):
    """A real `pip wheel` of this checkout (offline: no build isolation), uploaded through a
    stand-in for HfApi.batch_bucket_files."""
    seen = []

    class Api:
        def create_bucket(self, bucket_id, *, private, exist_ok, token):
            seen.append(("create", bucket_id, private, exist_ok, token))

        def batch_bucket_files(self, bucket_id, *, add, token):
            [(path, in_bucket)] = add
            with zipfile.ZipFile(path) as wheel:
                seen.append((bucket_id, in_bucket, token, set(wheel.namelist())))

    upload_to_buckets([(PACKAGE_WHEEL, f"{BUCKET}/sub/wheels/{package_wheel_name()}")],
                      token=TOKEN, api=Api(),
                      build_wheel=lambda out: build_package_wheel(out, isolated=False))
    created, (bucket_id, in_bucket, token, names) = seen  # the bucket exists before the upload
    assert created == ("create", "me/grpo-lora", True, True, TOKEN)
    assert (bucket_id, in_bucket, token) == ("me/grpo-lora", f"sub/wheels/{package_wheel_name()}",
                                             TOKEN)
    assert {"grpo_lab/cli/main.py", "grpo_lab/cli/__main__.py", "grpo_lab/launch/hf_jobs.py",
            "grpo_lab/serve/server.py"} <= names
    with pytest.raises(ValueError, match="Storage Bucket"):
        upload_to_buckets([("x.whl", "hf://buckets/me")], api=Api())


def test_bucket_mounts_become_hub_volumes_that_match_the_cli_spec():
    mount = BucketMount("hf://buckets/me/grpo-lora/run1", "/lora", read_only=True)
    trainer = hf_volume(BucketMount("hf://buckets/me/grpo-lora", "/lora"))
    replica = hf_volume(mount)
    assert trainer.to_dict() == {"type": "bucket", "source": "me/grpo-lora",
                                 "mountPath": "/lora", "readOnly": False}
    assert replica.path == "run1" and replica.read_only
    assert replica.to_uri() == mount.cli_spec() == "hf://buckets/me/grpo-lora/run1:/lora:ro"
    with pytest.raises(ValueError, match="Storage Buckets"):
        hf_volume(BucketMount("/tmp/bucket", "/lora"))


@pytest.mark.parametrize("trainer", ["grpo-lab", "trl"])
def test_a_trainer_flavor_with_several_gpus_runs_under_accelerate_launch_with_fsdp2(trainer):
    """One process per GPU of the flavor's name, FSDP2, for either trainer; one GPU: as before."""
    command = {"grpo-lab": "train-async", "trl": "train-trl-async"}[trainer]
    for flavor, gpus in (("h200x2", 2), ("l4x4", 4)):
        plan = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r", trainer=trainer,
                           trainer_flavor=flavor)
        last = plan["trainer"].command[2].splitlines()[-1]
        assert last.startswith("exec accelerate launch --use_fsdp --fsdp_version 2 "), last
        assert f"--num_processes {gpus} -m grpo_lab.cli {command} --model" in last
        assert "--device cuda" in last
    plan = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r", trainer=trainer,
                       trainer_flavor="a100-large")
    assert plan["trainer"].command[2].splitlines()[-1].startswith(f"exec grpo-lab {command} ")
    assert [flavor_gpus(f) for f in ("h200x2", "a100-large", "h200", "cpu-upgrade")] == [2, 1, 1, 0]


def test_launch_takes_the_recipes_knobs_and_the_forecast_simulates_them(capsys):
    """`--steps`, `--max-inflight` and `--token-budget` replace the blog's values in the trainer's
    command (once each, not appended twice), and the forecast printed beside the plan simulates
    them; trainer arguments after `--` on HF Jobs keep `--local-dir` (the mount takes whole-file
    writes only); a knob below 1 is named."""
    plan = recipe_plan(preset_config("blog", bucket=BUCKET, run_name="blog", steps=200,
                                     max_inflight=256, token_budget=8192))
    argv = shlex.split(plan["trainer"].command[2].splitlines()[-1])
    for flag, value in (("--steps", "200"), ("--max-inflight", "256"),
                        ("--token-budget", "8192")):
        assert argv.count(flag) == 1 and argv[argv.index(flag) + 1] == value, flag
    assert argv[argv.index("--dataset") + 1] == BLOG_TRAINING["dataset"]
    assert main(["launch", "--preset", "blog", "--dry-run", "--steps", "200",
                 "--max-inflight", "256", "--token-budget", "8192"]) == 0
    out = capsys.readouterr().out
    assert "# qwen2.5-math-1.5b (1.54 B parameters), 200 steps" in out
    assert "max_inflight 256, token_budget 8,192" in out
    own = recipe_plan(preset_config("blog", bucket=BUCKET, run_name="blog"),
                      trainer_args=["train-async", "--model", "{model}", "--steps", "5"])
    assert "--local-dir /tmp/grpo-lab-run" in own["trainer"].command[2]
    local = recipe_plan(backend="local", run_name="knobs", steps=3)
    assert " --steps 3" in " ".join(local["trainer"].command)
    for bad in ({"steps": 0}, {"max_inflight": -1}, {"token_budget": 1.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a whole number >= 1"):
            preset_config("blog", **bad)
