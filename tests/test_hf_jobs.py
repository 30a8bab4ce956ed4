"""The HF Jobs launcher, through a stand-in for `run_job` and the bucket uploads (no network, no
token)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from huggingface_hub import Volume
from launcher_helpers import BUCKET, PY, TOKEN, FakeJobs, blog_plan, flag_values

from grpo_lab.cli.flags import config_from_args
from grpo_lab.cli.main import build_parser, main
from grpo_lab.launch.hf_jobs import (
    HfJobsLauncher,
    hf_jobs_commands,
    package_source,
)
from grpo_lab.launch.local import LaunchError, fill_urls
from grpo_lab.launch.recipe_config import BLOG_TRAINING, RecipeConfig
from grpo_lab.launch.recipe_plan import recipe_plan
from grpo_lab.launch.replica_commands import max_lora_rank
from grpo_lab.launch.specs import (
    CPU_TORCH_INDEX,
    IMAGE_PINS,
    PACKAGE_WHEEL,
    package_wheel_name,
    wheel_install,
)
from grpo_lab.launch.trainer_args import LOCAL_RUN_DIR
from grpo_lab.serve.config import ServeConfig
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_job import TrainAsyncJobConfig


def test_hf_jobs_run_job_gets_exactly_the_blog_setup():
    fake = FakeJobs()
    launcher = HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload,
                              cancel_job=fake.cancel_job, environ={"HF_TOKEN": TOKEN})
    launcher.submit()
    replica_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1",
                   "PYTHONUNBUFFERED": "1", "HF_HOME": "/tmp/hf"}
    for i, call in enumerate(fake.calls[:2]):
        assert call == {
            "image": "vllm/vllm-openai:v0.27.1",
            "command": ["vllm", "serve", "Qwen/Qwen2.5-Math-1.5B", "--host", "0.0.0.0",
                        "--port", "8000", "--dtype", "bfloat16", "--max-model-len", "4096",
                        "--gpu-memory-utilization", "0.85", "--enable-lora",
                        "--max-lora-rank", "1", "--max-loras", "6", "--max-cpu-loras", "8",
                        "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"],
            "env": replica_env,
            "secrets": {"HF_TOKEN": TOKEN},
            "flavor": "h200",
            "timeout": "4h",
            "name": f"blog-replica-{i}",
            "labels": {"grpo-lab-run": "blog"},
            "volumes": [Volume(type="bucket", source="me/grpo-lora", mount_path="/lora",
                               read_only=True)],
            "expose": [8000],
        }
    trainer = fake.calls[2]
    script = trainer.pop("command")
    assert trainer == {
        "image": "vllm/vllm-openai:v0.27.1", "env": {"PYTHONUNBUFFERED": "1", "HF_HOME": "/tmp/hf"},
        "secrets": {"HF_TOKEN": TOKEN}, "flavor": "h200", "timeout": "4h", "name": "blog-trainer",
        "labels": {"grpo-lab-run": "blog"},
        "volumes": [Volume(type="bucket", source="me/grpo-lora", mount_path="/lora",
                           read_only=False)],
        "expose": None,
    }
    assert script[:2] == ["bash", "-c"]
    proxy_line = next(line for line in script[2].splitlines() if line.startswith("grpo-lab proxy"))
    assert proxy_line == ("grpo-lab proxy --host 127.0.0.1 --port 8000 "
                          f"--upstream https://{1:024x}--8000.hf.jobs "
                          f"--upstream https://{2:024x}--8000.hf.jobs "
                          "--upstream-token-env HF_TOKEN &")
    assert ("exec grpo-lab train-async --model Qwen/Qwen2.5-Math-1.5B --server-url "
            "http://127.0.0.1:8000 --output-dir /lora/blog --lora-rank 1 --max-staleness 4"
            in script[2])
    assert launcher.urls == {"replica-0": f"https://{1:024x}--8000.hf.jobs",
                             "replica-1": f"https://{2:024x}--8000.hf.jobs"}
    assert TOKEN not in blog_plan().describe() + hf_jobs_commands(blog_plan())


def test_hf_jobs_vllm_replicas_get_the_reference_settings():
    """Each vLLM setting of the reference's run_vllm_job.sh (AmineDiro/hfjobs-lora-buckets)."""
    for job in blog_plan().jobs:
        assert job.env["HF_HOME"] == "/tmp/hf"  # a writable Hub cache in every image
    flags = flag_values(blog_plan()["replica-0"].command)
    assert {f: flags[f] for f in ("--dtype", "--max-model-len", "--gpu-memory-utilization",
                                  "--max-lora-rank", "--max-loras", "--max-cpu-loras")} == {
        "--dtype": "bfloat16", "--max-model-len": "4096", "--gpu-memory-utilization": "0.85",
        "--max-lora-rank": "1", "--max-loras": "6", "--max-cpu-loras": "8"}
    own = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="own", max_staleness=1,
                      max_prompt_length=512, max_completion_length=1024,
                      gpu_memory_utilization=0.4, max_cpu_loras=5)
    flags = flag_values(own["replica-1"].command)
    assert (flags["--max-model-len"], flags["--gpu-memory-utilization"]) == ("1536", "0.4")
    assert (flags["--max-loras"], flags["--max-cpu-loras"]) == ("3", "5")
    too_few = r"max_cpu_loras \(5\) must be >= max_staleness \+ 2 \(6\)"
    with pytest.raises(ValueError, match=too_few):
        recipe_plan(backend="hf-jobs", bucket=BUCKET, max_cpu_loras=5)


def test_lora_ranks_round_up_to_what_vllm_accepts():
    """vLLM's --max-lora-rank takes 1, 8, 16, 32, ... (vllm/config/lora.py); the trainer keeps
    its own rank, the servers get the smallest bound that holds it."""
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 64, 320, 512)] == [1, 8, 8, 16, 64, 320, 512]
    for rank, bound in ((1, "1"), (2, "8"), (9, "16"), (64, "64")):
        plan = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r", lora_rank=rank)
        assert flag_values(plan["replica-0"].command)["--max-lora-rank"] == bound
        assert f"--lora-rank {rank} " in plan["trainer"].command[2]
    for too_big in (513, 1024):
        with pytest.raises(ValueError, match="above the largest --max-lora-rank vLLM accepts"):
            recipe_plan(backend="hf-jobs", bucket=BUCKET, lora_rank=too_big)


def test_grpo_lab_serve_replicas_get_only_flags_grpo_lab_serve_accepts(tmp_path):
    """The CPU stand-in parses every flag the plan gives it (argparse exits on an unknown one);
    the GPU-only vLLM settings stay off its command."""
    local = recipe_plan(bucket=str(tmp_path), run_name="r", lora_rank=9)["replica-0"].command
    cpu = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r", lora_rank=9,
                      replica_flavor="cpu-upgrade")["replica-0"].command
    exec_line = next(line for line in cpu[2].splitlines() if line.startswith("exec grpo-lab"))
    for argv in (local[3:], shlex.split(exec_line)[2:]):
        config = config_from_args(build_parser().parse_args(argv), ServeConfig)
        assert config.max_lora_rank == 16 and config.max_loras == 6
        assert not {"--dtype", "--gpu-memory-utilization", "--max-cpu-loras"} & set(argv)


@pytest.mark.parametrize("replica_flavor", ["h200", "cpu-upgrade"])
def test_hf_jobs_commands_pass_bash_n_and_call_python3(replica_flavor):
    """What each image runs: valid bash, and `python3` (the vLLM image has no `python`)."""
    plan = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r",
                       replica_flavor=replica_flavor, trainer_flavor=replica_flavor)
    urls = {job.name: f"https://{i:024x}--8000.hf.jobs" for i, job in enumerate(plan.jobs)}
    for job in plan.jobs:
        command = [fill_urls(arg, urls) for arg in job.command]
        text = command[2] if command[:2] == ["bash", "-c"] else shlex.join(command)
        checked = subprocess.run(["bash", "-n", "-c", text], capture_output=True, text=True)
        assert checked.returncode == 0, (job.name, checked.stderr)
        assert not re.search(r"(^|[\s;&|(`])python(\s|$)", text), (job.name, text)
    assert "python3 -m grpo_lab.launch.local wait-healthy" in plan["trainer"].command[2]


def test_hf_jobs_failed_submission_cancels_the_submitted_jobs():
    fake = FakeJobs(fail_at=3)
    launcher = HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload,
                              cancel_job=fake.cancel_job, environ={"HF_TOKEN": TOKEN})
    with pytest.raises(LaunchError, match="402"):
        launcher.submit()
    assert fake.cancelled == [f"{2:024x}", f"{1:024x}"]


def test_hf_jobs_missing_token_submits_nothing():
    fake = FakeJobs()
    with pytest.raises(LaunchError, match="HF_TOKEN"):
        HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload, environ={}).submit()
    assert fake.calls == []


def test_dry_run_prints_the_hf_jobs_run_lines(capsys):
    assert main(["launch", "--backend", "hf-jobs", "--dry-run", "--bucket", BUCKET,
                 "--run-name", "blog"]) == 0
    out = capsys.readouterr().out
    assert out.count("hf jobs run --detach") == 3
    assert out.count(f"-v {BUCKET}:/lora:ro") == 2 and out.count(f"-v {BUCKET}:/lora ") == 1
    assert out.count("--secrets HF_TOKEN") == 3 and "--expose 8000" in out
    assert "REPLICA_0_ID=$(hf jobs run --detach --quiet --name blog-replica-0 --flavor h200" in out
    assert "--upstream https://${REPLICA_1_ID}--8000.hf.jobs" in out


def test_local_dry_run_with_the_trainer_arguments_replaced(tmp_path, capsys):
    assert main(["launch", "--dry-run", "--bucket", str(tmp_path), "--run-name", "r", "--replicas",
                 "3", "--", "train-async", "--steps", "5", "--server-url", "{proxy_url}"]) == 0
    out = capsys.readouterr().out.split("\n\n")[-1]  # after the plan: the shell lines
    assert out.count("-m grpo_lab.cli serve tiny --host 127.0.0.1") == 3
    proxy_port = re.search(r"grpo_lab.cli proxy --host 127.0.0.1 --port (\d+)", out).group(1)
    assert f"grpo_lab.cli train-async --steps 5 --server-url http://127.0.0.1:{proxy_port}\n" in out
    assert not (tmp_path / "logs").exists()  # nothing started
    # what the replaced arguments leave out of the default ones is said
    assert main(["launch", "--dry-run", "--backend", "hf-jobs", "--bucket", "hf://buckets/me/b",
                 "--replica-flavor", "h200", "--trainer-flavor", "h200", "--run-name", "t", "--",
                 "train-async", "--server-url", "{proxy_url}", "--output-dir", "{output_dir}"]) == 0
    err = capsys.readouterr().err
    assert "leave out --model --lora-rank --max-staleness --bucket --device --resume " \
           "--local-dir" in err and "--dataset" in err and "bucket mount fails" in err


def test_dry_run_lines_run_in_bash_give_the_same_jobs_as_run_job(tmp_path):
    """Copy-pasteable: bash runs the printed lines against a stand-in `hf` that records its argv
    and answers an id; each recorded job matches what `run_job` gets for the same ids."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "hf").write_text(textwrap.dedent(f"""\
        #!{PY}
        import json, pathlib, sys
        log = pathlib.Path({str(tmp_path / "calls.jsonl")!r})
        calls = [c for c in (log.read_text().splitlines() if log.exists() else [])
                 if c.startswith('["jobs"')]
        log.open("a").write(json.dumps(sys.argv[1:]) + "\\n")
        print(f"{{len(calls) + 1:024x}}")
    """))
    (bin_dir / "hf").chmod(0o755)
    (bin_dir / "python3").write_text(textwrap.dedent(f"""\
        #!{PY}
        import json, pathlib, sys
        pathlib.Path({str(tmp_path / "python3.json")!r}).write_text(json.dumps(sys.argv[1:]))
    """))
    (bin_dir / "python3").chmod(0o755)
    script = tmp_path / "launch.sh"
    script.write_text("set -e\n" + hf_jobs_commands(blog_plan()) + "\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    subprocess.run(["bash", str(script)], check=True, env=env, timeout=30)
    recorded = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    # first the grpo_lab wheel: built here, copied into the bucket the jobs install it from
    wheel = package_wheel_name()
    built = json.loads((tmp_path / "python3.json").read_text())
    assert built[:5] == ["-m", "pip", "wheel", "--no-deps", "--quiet"]
    assert built[-3:] == ["--wheel-dir", "dist", str(package_source())]
    assert recorded.pop(0) == ["buckets", "cp", f"dist/{wheel}", f"{BUCKET}/blog/wheels/{wheel}"]
    fake = FakeJobs()
    HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload,
                   environ={"HF_TOKEN": TOKEN}).submit()
    assert len(recorded) == len(fake.calls) == 3
    for argv, call in zip(recorded, fake.calls):
        split = argv.index("--")
        options, (image, *command) = argv[:split], argv[split + 1:]
        assert options[:3] == ["jobs", "run", "--detach"]
        assert image == call["image"] and command == call["command"]
        pairs = dict(zip(options[3:], options[4:]))
        assert pairs["--name"] == call["name"] and pairs["--flavor"] == call["flavor"]
        assert pairs["--timeout"] == call["timeout"]
        assert [options[i + 1] for i, o in enumerate(options) if o == "--label"] == \
            [f"{k}={v}" for k, v in call["labels"].items()]
        assert [options[i + 1] for i, o in enumerate(options) if o == "-v"] == \
            [v.to_uri().removesuffix(":rw") for v in call["volumes"]]
        assert [options[i + 1] for i, o in enumerate(options) if o == "-e"] == \
            [f"{k}={v}" for k, v in call["env"].items()]
        assert [options[i + 1] for i, o in enumerate(options) if o == "--secrets"] == \
            list(call["secrets"])

    # and the real `hf` CLI parses such a line as intended (its --dry-run: offline, no token)
    hf = Path(PY).parent / "hf"
    if not hf.exists() and not shutil.which("hf"):
        return
    argv = recorded[2]
    argv = [*argv[:2], "--dry-run", *[a for a in argv[2:] if a != "--detach"]]
    out = subprocess.run([str(hf) if hf.exists() else "hf", *argv], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if out.returncode and ("Not logged in" in out.stderr or "whoami" in out.stderr):
        return  # a CLI whose --dry-run asks the Hub who you are (huggingface_hub 1.24, the floor)
    assert out.returncode == 0, out.stderr
    assert f"volumes  {BUCKET}:/lora" in out.stdout and "secrets  HF_TOKEN" in out.stdout
    assert "grpo-lab proxy --host 127.0.0.1" in out.stdout


def test_hf_jobs_install_grpo_lab_from_a_wheel_put_in_the_bucket_before_any_job():
    fake = FakeJobs()
    HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload,
                   environ={"HF_TOKEN": TOKEN}).submit()
    wheel = package_wheel_name()
    assert fake.uploads == [([(PACKAGE_WHEEL, f"{BUCKET}/blog/wheels/{wheel}")], TOKEN, 0)]
    script = fake.calls[2]["command"][2]
    # the mount may lag the upload: wait for the file (bounded), then install it, retried
    install = wheel_install(f"/lora/blog/wheels/{wheel}", image_has_torch=True)
    assert script.startswith("set -e\n" + install)
    assert (f"\nfor _ in $(seq 120); do test -f /lora/blog/wheels/{wheel} && break; sleep 5; done"
            f"\npip list --format=freeze > {IMAGE_PINS}"  # the image's versions, held
            f"\nfor attempt in $(seq 5); do\n  pip install --quiet --retries 5 --constraint "
            f"{IMAGE_PINS} /lora/blog/wheels/{wheel} && break\n") in script  # no extras
    # a CPU replica runs grpo-lab serve: it installs the same wheel from its read-only mount,
    # with torch's CPU build (the CPU image has no torch)
    cpu = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="cpu",
                      replica_flavor="cpu-upgrade")
    replica = cpu["replica-0"].command[2]
    install = wheel_install(f"/lora/cpu/wheels/{wheel}", image_has_torch=False)
    assert replica == ("set -e\n" + install + "\nexec grpo-lab serve"
                       + replica.split("exec grpo-lab serve", 1)[1])
    assert f"--extra-index-url {CPU_TORCH_INDEX} /lora/cpu/wheels/{wheel}" in replica
    # an install command of your own: nothing to upload
    own = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="own",
                      install="pip install git+https://github.com/me/grpo_lab")
    assert own.uploads == [] and "\npip install git+https://github.com/me/grpo_lab\n" in \
        own["trainer"].command[2]


@pytest.mark.parametrize("failures, code, calls", [(2, 0, 3), (9, 1, 5)])
def test_the_job_install_retries_pip_five_times(tmp_path, failures, code, calls):
    """The install lines in bash, with a `pip` that fails `failures` times (and a `sleep` that
    returns at once): it succeeds on a later attempt, or gives up after five with an error."""
    wheel = tmp_path / "mount" / package_wheel_name()
    wheel.parent.mkdir()
    wheel.write_bytes(b"wheel")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(textwrap.dedent(f"""\
        #!/bin/bash
        [ "$1" = list ] && echo "torch==2.13.0" && exit 0  # the image's own versions
        echo "$@" >> {tmp_path / "pip-calls"}
        [ "$(wc -l < {tmp_path / "pip-calls"})" -gt {failures} ]
    """))
    (bin_dir / "sleep").write_text("#!/bin/bash\ntrue\n")
    for tool in ("pip", "sleep"):
        (bin_dir / tool).chmod(0o755)
    script = f"set -e\n{wheel_install(str(wheel), image_has_torch=True)}\necho installed\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    pip_calls = (tmp_path / "pip-calls").read_text().splitlines()
    assert (out.returncode, len(pip_calls)) == (code, calls), out.stdout + out.stderr
    assert pip_calls[0] == f"install --quiet --retries 5 --constraint {IMAGE_PINS} {wheel}"
    assert ("installed" in out.stdout) == (code == 0)


def test_the_trainer_device_and_training_follow_the_flavor(tmp_path):
    """GPU trainer: `--device cuda` and the blog's training; CPU: `--device cpu` and
    train-async's CPU-sized defaults; on HF Jobs the logs go to a local folder (the mount takes
    whole files); locally nothing changes."""
    def trainer_flags(plan):
        command = plan["trainer"].command
        in_bash = command[:2] == ["bash", "-c"]
        argv = shlex.split(command[2].splitlines()[-1]) if in_bash else command
        return flag_values(argv)

    gpu = trainer_flags(blog_plan())
    assert gpu["--device"] == "cuda" and gpu["--local-dir"] == LOCAL_RUN_DIR
    # train-async takes every flag and every value (its configs validate at construction)
    argv = shlex.split(blog_plan()["trainer"].command[2].splitlines()[-1])[2:]
    args = build_parser().parse_args(argv)
    config = config_from_args(args, AsyncGRPOConfig)
    assert config_from_args(args, TrainAsyncJobConfig).local_dir == LOCAL_RUN_DIR
    assert (config.loss_type, config.weight_sync_steps, config.token_budget) == ("dapo", 4, 16384)
    assert {k: gpu[k] for k in ("--dataset", "--learning-rate", "--max-completion-length",
                                "--weight-sync-steps")} == {
        "--dataset": "sail/Sanity-Test-R1D-1.5B", "--learning-rate": "4e-05",
        "--max-completion-length": "3000", "--weight-sync-steps": "4"}
    assert trainer_flags(recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r",
                                     max_completion_length=512))["--max-completion-length"] == "512"
    cpu = trainer_flags(recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r",
                                    trainer_flavor="cpu-upgrade"))
    assert cpu["--device"] == "cpu" and cpu["--local-dir"] == LOCAL_RUN_DIR
    assert not {"--dataset", "--learning-rate", "--max-completion-length"} & set(cpu)
    local = trainer_flags(recipe_plan(bucket=str(tmp_path), run_name="r"))
    assert local["--device"] == "auto" and "--local-dir" not in local



def test_block_size_reaches_every_replica_and_the_proxy(tmp_path):
    """One KV block size for the replicas' prefix caches and the router: a router hashing other
    blocks than the servers cache would route on prefixes nobody holds."""
    plan = recipe_plan(bucket=str(tmp_path), run_name="r", block_size=4)
    for name in ("replica-0", "replica-1", "proxy"):
        argv = plan[name].command
        assert argv[argv.index("--block-size") + 1] == "4", name
    gpu = {name: blog_plan(block_size=block)["replica-0"].command for name, block in
           (("default", 16), ("eight", 8))}
    assert "--block-size" not in gpu["default"]  # vLLM's own default, as the reference runs it
    assert gpu["eight"][gpu["eight"].index("--block-size") + 1] == "8"
    with pytest.raises(ValueError, match="block_size"):
        recipe_plan(bucket=str(tmp_path), block_size=0)

def test_trainer_trl_runs_trls_job_with_flags_it_takes(tmp_path):
    """`--trainer trl`: the trainer job runs `grpo-lab train-trl-async` (TRL's AsyncGRPOTrainer),
    every flag of which its own parser accepts: on a GPU the blog's training without train-async's
    own --request-shape, with its checkpoints; --resume (a restarted job continues from TRL's
    newest checkpoint) and no --local-dir (the job rewrites its files whole); the wheel's `trl`
    extra and `kernels` (TRL's attention kernel) installed in the vLLM image."""
    from grpo_lab.trl.async_job import TrlAsyncJobConfig

    plans = {"gpu": blog_plan(trainer="trl"),
             "gpu-trainer-cpu-replicas": recipe_plan(backend="hf-jobs", bucket=BUCKET,
                                                     run_name="r", trainer="trl",
                                                     replica_flavor="cpu-upgrade"),
             "local": recipe_plan(bucket=str(tmp_path), run_name="r", trainer="trl")}
    for where, plan in plans.items():
        command = plan["trainer"].command
        script = command[2] if command[:2] == ["bash", "-c"] else None
        argv = shlex.split(script.splitlines()[-1])[2:] if script else command
        argv = argv[argv.index("train-trl-async"):]  # after `grpo-lab` or `python -m grpo_lab.cli`
        assert "--resume" in argv and "--local-dir" not in argv, where
        args = build_parser(argv[0]).parse_args(argv)  # exits on any flag it does not take
        job = config_from_args(args, TrlAsyncJobConfig)
        assert job.server_url.startswith("http://127.0.0.1:") and job.resume, where
        if where == "gpu":
            config = config_from_args(args, AsyncGRPOConfig)
            assert (config.learning_rate, config.weight_sync_steps, config.device) == (
                4e-5, 4, "cuda")
            assert job.checkpoint_every == BLOG_TRAINING["checkpoint_every"] == 20
            assert "--request-shape" not in argv
        if script:  # the wheel with its `trl` extra (the core has no TRL), and TRL's kernels
            install = script.split("pip install", 1)[1].splitlines()[0]
            assert "kernels" in install and "[trl]" in install, install
    with pytest.raises(ValueError, match="trainer must be"):
        recipe_plan(bucket=str(tmp_path), trainer="deepspeed")


def test_trainer_trl_on_a_cpu_flavor_is_refused(capsys):
    """A cpu-* trainer runs in python:3.12, which has no vLLM, and TRL's AsyncGRPOTrainer does
    not start without it: the plan refuses, and `grpo-lab launch` says why with exit status 2."""
    with pytest.raises(ValueError, match=r"--trainer trl needs a GPU --trainer-flavor.*no vLLM"):
        recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r", trainer="trl",
                    trainer_flavor="cpu-upgrade", replica_flavor="cpu-upgrade")
    assert main(["launch", "--backend", "hf-jobs", "--dry-run", "--bucket", BUCKET,
                 "--trainer", "trl", "--trainer-flavor", "cpu-basic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo-lab: error: --trainer trl needs a GPU") and "python:3.12" in err
    # the same CPU flavor with grpo_lab's own trainer stays a valid plan
    recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r", trainer_flavor="cpu-upgrade")


def test_a_jobs_timeout_follows_the_forecast(tmp_path, capsys):
    """Without --timeout, a GPU plan's jobs get the forecast wall clock with a margin; a given
    timeout shorter than the forecast is refused before anything is submitted (issue 47)."""
    from grpo_lab.cli.launch import TIMEOUT_MARGIN, timeout_from_forecast, timeout_seconds

    config = RecipeConfig(backend="hf-jobs", bucket="me/b", replica_flavor="h200",
                          trainer_flavor="h200")
    fitted, how = timeout_from_forecast(config, 2 * 3600, given=False)
    assert timeout_seconds(fitted.timeout) >= 2 * 3600 * TIMEOUT_MARGIN and "forecast" in how
    with pytest.raises(ValueError, match="longer than --timeout 1h"):
        timeout_from_forecast(replace(config, timeout="1h"), 2 * 3600, given=True)
    assert main(["launch", "--dry-run", "--backend", "hf-jobs", "--bucket", "hf://buckets/me/b",
                 "--replica-flavor", "h200", "--trainer-flavor", "h200", "--run-name", "t"]) == 0
    out = capsys.readouterr().out
    assert "timeout: --timeout " in out and "--timeout 4h" not in out
    assert main(["launch", "--dry-run", "--backend", "hf-jobs", "--bucket", "hf://buckets/me/b",
                 "--replica-flavor", "h200", "--trainer-flavor", "h200", "--run-name", "t",
                 "--timeout", "30m"]) == 2
    assert "would be killed" in capsys.readouterr().err
    # a model the planner does not know: the timeout kept is said, with why it was not fitted
    assert main(["launch", "--dry-run", "--backend", "hf-jobs", "--bucket", "hf://buckets/me/b",
                 "--replica-flavor", "h200", "--trainer-flavor", "h200", "--run-name", "t",
                 "--base-model", "someone/unknown-model"]) == 0
    assert "timeout: --timeout 4h (the default; no forecast to check it against" in \
        capsys.readouterr().out


def test_the_install_holds_the_images_own_versions(tmp_path):
    """The job's install, resolved offline against an "image" (this environment, with grpo_lab's
    dependencies installed): under the image's own versions as constraints the wheel installs
    without moving one of them; a pin grpo_lab cannot live with stops the install, named,
    instead of replacing the image's package."""
    import sys

    from grpo_lab.launch.hf_jobs import build_package_wheel

    wheel = build_package_wheel(tmp_path / "wheel", isolated=False)  # the jobs' own wheel
    pins = tmp_path / "pins.txt"
    listed = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze",
                             "--exclude-editable"], capture_output=True, text=True, timeout=120)
    pins.write_text(listed.stdout)

    def dry_run(constraints: Path, report: bool = True):  # the job's `pip install`, offline
        return subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
             *(("--report", "-", "--quiet") if report else ()), "--constraint", str(constraints),
             str(wheel)], capture_output=True, text=True, timeout=300)

    held = dry_run(pins)
    assert held.returncode == 0, held.stderr[-3000:]
    report = json.loads(held.stdout)
    moved = [i["metadata"]["name"] for i in report["install"]
             if i["metadata"]["name"].lower().replace("_", "-") != "grpo-lab"]
    assert moved == [], f"the install would replace the image's {moved}"
    conflicting = tmp_path / "old-image.txt"
    conflicting.write_text(listed.stdout.replace(
        next(line for line in listed.stdout.splitlines() if line.lower().startswith(
            "transformers==")), "transformers==4.0.0"))
    refused = dry_run(conflicting, report=False)
    said = refused.stdout + refused.stderr  # pip explains the conflict on stdout
    assert refused.returncode != 0 and "transformers" in said, said[-2000:]


def test_a_network_group_puts_the_replicas_behind_their_aliases(capsys):
    """`--network-group`: every job joins the run's group under its own name, and the trainer's
    proxy reaches the replicas at `${HF_NETWORK_GROUP_PREFIX}<alias>` (expanded by the job's
    shell), not at their public URLs; the launcher still waits on the public URLs. Where
    huggingface_hub's `run_job` has no network groups, the public URLs are the fallback, said."""
    fake = FakeJobs()

    def run_job(*, image, command, env=None, secrets=None, flavor=None, timeout=None,
                labels=None, volumes=None, expose=None, name=None, network_group=None,
                network_aliases=None, namespace=None):
        return fake.run_job(image=image, command=command, env=env, secrets=secrets,
                            flavor=flavor, timeout=timeout, labels=labels, volumes=volumes,
                            expose=expose, name=name, network_group=network_group,
                            network_aliases=network_aliases)

    plan = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="Blog_run", network_group=True)
    assert plan.network_group == "blog-run"  # the Hub's form: lowercase and dashes
    HfJobsLauncher(plan, run_job=run_job, upload=fake.upload,
                   environ={"HF_TOKEN": TOKEN}).submit()
    assert [(c["network_group"], c["network_aliases"]) for c in fake.calls] == [
        ("blog-run", ["replica-0"]), ("blog-run", ["replica-1"]), ("blog-run", ["trainer"])]
    script = fake.calls[2]["command"][2]
    proxy_line = next(line for line in script.splitlines() if line.startswith("grpo-lab proxy"))
    expanded = subprocess.run(["bash", "-c", f"echo {proxy_line.removesuffix(' &')}"],
                              capture_output=True, text=True, timeout=10,
                              env={**os.environ, "HF_NETWORK_GROUP_PREFIX": "ng-"})
    assert "--upstream http://ng-replica-0:8000 --upstream http://ng-replica-1:8000" in \
        expanded.stdout, expanded.stdout
    assert "hf.jobs" not in proxy_line
    fallback = FakeJobs()  # `run_job(**kwargs)`: no network_group parameter
    HfJobsLauncher(blog_plan(network_group=True), run_job=fallback.run_job, upload=fallback.upload,
                   environ={"HF_TOKEN": TOKEN}).submit()
    assert "network_group" not in fallback.calls[0]
    assert "hf.jobs --upstream" in fallback.calls[2]["command"][2]
    assert "no network groups: the jobs reach each other at their public URLs" in \
        capsys.readouterr().err
