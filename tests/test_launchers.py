"""Job specs, the local launcher (real processes, small stand-ins) and the HF Jobs launcher
(through a fake `run_job`: no network, no token)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import zipfile
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import Volume

from grpo_lab.cli.flags import config_from_args, field_docs
from grpo_lab.cli.main import build_parser, main
from grpo_lab.jobs.blog import BLOG_TRAINING, PRESETS
from grpo_lab.jobs.hf_jobs import (
    HfJobsLauncher,
    build_package_wheel,
    hf_jobs_commands,
    hf_volume,
    package_source,
    upload_to_buckets,
)
from grpo_lab.jobs.install import CPU_TORCH_INDEX, wheel_install
from grpo_lab.jobs.local import LaunchError, LocalLauncher, _main, fill_urls
from grpo_lab.jobs.plan import (
    LOCAL_RUN_DIR,
    RecipeConfig,
    max_lora_rank,
    preset_config,
    recipe_plan,
)
from grpo_lab.jobs.specs import (
    PACKAGE_WHEEL,
    BucketMount,
    JobSpec,
    RunPlan,
    flavor_gpus,
    free_port,
    package_wheel_name,
)
from grpo_lab.jobs.train_async_job import TrainAsyncJobConfig
from grpo_lab.observe.live_stats import proxy_stats, router_counters
from grpo_lab.rollout.config import AsyncGRPOConfig
from grpo_lab.serving.config import ServeConfig
from grpo_lab.serving.process import group_members, is_alive

PY = sys.executable
# A stand-in server: prints LINES log lines, optionally spawns a grandchild that ignores
# SIGTERM (its pid goes to PIDFILE), then serves /health on PORT (0 = never listens).
DUMMY = textwrap.dedent("""
    import http.server, subprocess, sys, time
    port, pidfile, lines = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(lines):
        print(f"log line {i}", flush=True)
    if pidfile != "-":
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"])
        open(pidfile, "w").write(str(child.pid))
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    if port:
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    time.sleep(120)
""")


def server_job(name, port=None, pidfile="-", lines=0, health_timeout_s=20.0, **kw) -> JobSpec:
    port = free_port() if port is None else port
    return JobSpec(name=name, command=[PY, "-c", DUMMY, str(port), str(pidfile), str(lines)],
                   health_url=f"http://127.0.0.1:{port}/health",
                   health_timeout_s=health_timeout_s, **kw)


def wait_dead(pids, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(is_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def assert_no_orphans(launcher: LocalLauncher, extra_pids=()):
    for name, proc in launcher.procs.items():
        assert proc.poll() is not None, f"{name} still running"
        assert group_members(proc.pid) == [], f"{name}'s process group still has members"
    assert wait_dead(extra_pids, 2.0), "a grandchild survived"


@pytest.fixture
def kill_on_failure():
    """Processes a test started outside a launcher: killed by group whatever happens."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --------------------------------------------------------------------------------- local launcher

def test_jobs_start_in_order_and_stop_with_their_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    a = server_job("a", pidfile=pidfile, lines=3)
    # b refuses to start unless a already answers: checks the dependency order
    b_port = free_port()
    check = (f"import urllib.request; urllib.request.urlopen({a.health_url!r}, timeout=2); "
             f"exec(open({str(tmp_path / 'dummy.py')!r}).read())")
    (tmp_path / "dummy.py").write_text(DUMMY)
    b = JobSpec(name="b", command=[PY, "-c", check, str(b_port), "-", "0"], depends_on=["a"],
                health_url=f"http://127.0.0.1:{b_port}/health", health_timeout_s=20)
    plan = RunPlan([a, b], name="t")
    assert [[j.name for j in wave] for wave in plan.waves()] == [["a"], ["b"]]
    with LocalLauncher(plan, tmp_path / "run", grace_s=1.0) as run:
        status = run.status()
        assert status["a"].startswith("running") and status["b"].startswith("running")
        grandchild = int(pidfile.read_text())
        assert is_alive(grandchild)
        assert run.logs("a", tail=2) == "log line 1\nlog line 2"
        assert json.loads((tmp_path / "run" / "plan.json").read_text())["name"] == "t"
    # the grandchild ignores SIGTERM: only the SIGKILL after the grace period ends it
    assert_no_orphans(run, [grandchild])
    assert run.status() == {"a": "stopped", "b": "stopped"}


def test_a_job_that_never_becomes_healthy_fails_with_its_log_tail(tmp_path):
    first = server_job("first")
    silent = server_job("silent", port=0, lines=100, health_timeout_s=1.0)
    silent.health_url = f"http://127.0.0.1:{free_port()}/health"  # nobody listens there
    launcher = LocalLauncher(RunPlan([first, silent]), tmp_path, grace_s=1.0)
    with pytest.raises(LaunchError) as err:
        launcher.start()
    message = str(err.value)
    assert "'silent'" in message and "not healthy after 1 s" in message
    assert re.search(r"\blog line 99\b", message) and re.search(r"\blog line 60\b", message)
    assert not re.search(r"\blog line 59\b", message)  # the last 40 lines only
    assert_no_orphans(launcher)  # `first` was healthy, and is stopped too


def test_a_job_that_crashes_fails_with_its_exit_code_and_log(tmp_path):
    crash = JobSpec(name="crash", command=[PY, "-c", "print('boom: bad flag'); exit(3)"],
                    health_url=f"http://127.0.0.1:{free_port()}/health", health_timeout_s=20)
    launcher = LocalLauncher(RunPlan([server_job("ok"), crash]), tmp_path, grace_s=1.0)
    with pytest.raises(LaunchError, match=r"(?s)'crash' exited with code 3.*boom: bad flag"):
        launcher.start()
    assert_no_orphans(launcher)
    assert launcher.status()["crash"] == "failed (code 3)"


def test_no_orphans_when_the_body_raises(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(RuntimeError, match="the notebook cell failed"):
        with LocalLauncher(RunPlan([server_job("a", pidfile=pidfile)]), tmp_path, grace_s=1.0) as run:
            raise RuntimeError("the notebook cell failed")
    assert_no_orphans(run, [int(pidfile.read_text())])


def test_wait_returns_the_exit_code_and_notices_a_dying_dependency(tmp_path):
    done = JobSpec(name="done", command=[PY, "-c", "import time; time.sleep(0.3)"], depends_on=["a"])
    with LocalLauncher(RunPlan([server_job("a"), done]), tmp_path / "1", grace_s=1.0) as run:
        assert run.wait("done", timeout_s=20) == 0
        assert run.status()["done"] == "exited (0)"
    sleeper = JobSpec(name="trainer", command=[PY, "-c", "import time; time.sleep(60)"])
    with LocalLauncher(RunPlan([server_job("replica"), sleeper]), tmp_path / "2", grace_s=1.0) as run:
        os.killpg(run.procs["replica"].pid, signal.SIGKILL)
        with pytest.raises(LaunchError, match="'replica' exited with code -9 while waiting for 'trainer'"):
            run.wait("trainer", timeout_s=20)
    assert_no_orphans(run)


def test_preempt_and_restart_kills_the_whole_job_and_starts_it_again(tmp_path):
    """A preemption: SIGKILL to the job's process group (its own children too), then the same
    command again, healthy before it returns; the stop at the end takes the new process too."""
    pidfile = tmp_path / "grandchild.pid"
    with LocalLauncher(RunPlan([server_job("a", pidfile=pidfile)]), tmp_path, grace_s=1.0) as run:
        first, first_child = run.procs["a"], int(pidfile.read_text())
        assert run.preempt_and_restart("a") == -signal.SIGKILL
        assert wait_dead([first.pid, first_child])
        assert run.procs["a"] is not first and run.running("a")
        assert int(pidfile.read_text()) != first_child  # the new process wrote its own
    assert_no_orphans(run, [int(pidfile.read_text())])

def test_missing_secret_or_unmountable_bucket_starts_nothing(tmp_path):
    job = server_job("a", secrets=["GRPO_LAB_TEST_SECRET"])
    launcher = LocalLauncher(RunPlan([job]), tmp_path, environ={})
    with pytest.raises(LaunchError, match="GRPO_LAB_TEST_SECRET"):
        launcher.start()
    assert launcher.procs == {}
    mounted = server_job("b", volumes=[BucketMount(str(tmp_path / "bucket"), "/lora")])
    launcher = LocalLauncher(RunPlan([mounted]), tmp_path)
    with pytest.raises(LaunchError, match="cannot mount"):
        launcher.start()
    assert launcher.procs == {}


LAUNCHER_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from grpo_lab.jobs.specs import JobSpec, RunPlan
    from grpo_lab.jobs.local import LocalLauncher
    job = JobSpec(name="a", command=[sys.executable, "-c", sys.argv[2], sys.argv[3], sys.argv[4], "0"],
                  health_url=f"http://127.0.0.1:{sys.argv[3]}/health", health_timeout_s=20)
    keep = []
    def start():
        keep.append(LocalLauncher(RunPlan([job]), sys.argv[5], grace_s=1.0).start())
    if sys.argv[1] == "killed":   # main thread, then SIGKILLed: PR_SET_PDEATHSIG
        start()
        print(keep[0].procs["a"].pid, flush=True)
        time.sleep(60)
    else:                         # another thread (no PDEATHSIG), then a normal exit: finalizer
        thread = threading.Thread(target=start)
        thread.start(); thread.join()
        print(keep[0].procs["a"].pid, flush=True)
""")


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_no_orphans_when_the_launching_process_goes_away(tmp_path, how, kill_on_failure):
    """A kernel restart: a normal interpreter exit runs the finalizer; a SIGKILLed kernel
    runs nothing, so the job's own PR_SET_PDEATHSIG ends it."""
    pidfile = tmp_path / "grandchild.pid"
    grandchild_file = pidfile if how == "exits" else "-"
    proc = subprocess.Popen([PY, "-c", LAUNCHER_SCRIPT, how, DUMMY, str(free_port()), str(grandchild_file),
                             str(tmp_path / "run")], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    kill_on_failure.append(proc.pid)
    try:
        job_pid = int(proc.stdout.readline())
        kill_on_failure.append(job_pid)  # its process group
        if how == "killed":
            assert is_alive(job_pid)
            proc.kill()
        proc.wait(timeout=30)
        # exits: the finalizer stops the whole group; killed: the kernel SIGTERMs the job
        # itself (its own children are its business then: vLLM's engine core watches its parent)
        assert wait_dead([job_pid], 10)
        if how == "exits":
            assert wait_dead([int(pidfile.read_text())], 2) and group_members(job_pid) == []
    finally:
        proc.stdout.close()


def test_wait_healthy_cli_fails_fast_without_a_server():
    assert _main(["wait-healthy", f"http://127.0.0.1:{free_port()}/health", "--timeout-s", "0.3"]) == 1


# ------------------------------------------------------------------------------------ the plans

def test_local_recipe_plan(tmp_path):
    plan = recipe_plan(bucket=str(tmp_path / "bucket"), run_name="r1")
    assert plan.names == ["replica-0", "replica-1", "proxy", "trainer"]
    assert [[j.name for j in w] for w in plan.waves()] == [["replica-0", "replica-1"], ["proxy"], ["trainer"]]
    mount = str(tmp_path / "bucket")
    for name in ("replica-0", "replica-1"):
        job = plan[name]
        assert job.volumes == [BucketMount(mount, mount, read_only=True)]
        assert job.command[1:5] == ["-m", "grpo_lab.cli", "serve", "tiny"]
        assert shlex.join(job.command).count("--enable-lora --max-lora-rank 1 --max-loras 6 "
                                             "--logprobs-mode processed_logprobs") == 1
        assert job.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == job.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert job.health_url == f"http://127.0.0.1:{job.ports[0]}/health"
    upstreams = [f"http://127.0.0.1:{plan[n].ports[0]}" for n in ("replica-0", "replica-1")]
    proxy = plan["proxy"].command
    assert proxy[3:4] == ["proxy"] and [proxy[i + 1] for i, a in enumerate(proxy) if a == "--upstream"] == upstreams
    trainer = plan["trainer"]
    assert trainer.volumes == [BucketMount(mount, mount, read_only=False)]
    assert trainer.command[3] == "train-async" and f"{mount}/r1" in trainer.command
    assert f"http://127.0.0.1:{plan['proxy'].ports[0]}" in trainer.command
    command = recipe_plan(max_staleness=1, run_name="x", bucket=mount)["replica-0"].command
    assert command[command.index("--max-loras") + 1] == "3"  # max_staleness + 2


def test_local_recipe_replica_and_proxy_are_real_grpo_lab_servers(tmp_path, tiny_model_dir):
    """The plan's flags reach `grpo-lab serve` (LoRA slots = max_staleness + 2, rank 1) and
    `grpo-lab proxy`, which answers for the replica; the dashboard reads its counters."""
    plan = recipe_plan(bucket=str(tmp_path / "bucket"), run_name="r", replicas=1,
                       health_timeout_s=120)
    proxy_url = plan["proxy"].health_url.removesuffix("/health")
    with LocalLauncher(plan.only("replica-0", "proxy"), tmp_path / "run", grace_s=5) as run:
        with urllib.request.urlopen(f"{proxy_url}/server_info?config_format=json", timeout=10) as r:
            config = json.loads(r.read())["vllm_config"]
        counters = router_counters(proxy_stats(proxy_url))
        assert all(s.startswith("running") for s in run.status().values())
    assert config["lora_config"]["max_loras"] == 6 and config["lora_config"]["max_lora_rank"] == 1
    assert config["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert config["grpo_lab"]["allowed_lora_root"] == str(tmp_path / "bucket")
    assert counters == {"affinity": 0, "spilled": 0, "unmatched": 0, "routed": [0]}
    assert run.status() == {"replica-0": "stopped", "proxy": "stopped"}
    assert_no_orphans(run)


def test_plan_validation():
    for cls in (RecipeConfig, JobSpec, BucketMount):  # one copy of the help text, for every flag
        assert set(field_docs(cls)) == set(cls.__dataclass_fields__), cls
    with pytest.raises(ValueError, match="not earlier in the plan"):
        RunPlan([JobSpec(name="t", command=["x"], depends_on=["r"]), JobSpec(name="r", command=["x"])])
    with pytest.raises(ValueError, match="HF Jobs need a Storage Bucket"):
        recipe_plan(backend="hf-jobs")
    with pytest.raises(ValueError, match="absolute"):
        BucketMount("hf://buckets/me/b", "lora")


# ------------------------------------------------------------------------------------- HF Jobs

BUCKET = "hf://buckets/me/grpo-lora"
TOKEN = "hf_fake_token_for_tests"


def blog_plan(**fields):
    """The blog's GPU setup: Qwen2.5-Math-1.5B, rank 1, two H200 replicas."""
    return recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="blog", **fields)


class FakeJobs:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.cancelled, self.fail_at = [], [], fail_at
        self.uploads = []  # (uploads, token) per upload call, in order with the job calls

    def upload(self, uploads, token=None):
        self.uploads.append((list(uploads), token, len(self.calls)))

    def run_job(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) == self.fail_at:
            raise RuntimeError("402 Payment Required")
        job_id = f"{len(self.calls):024x}"
        urls = [f"https://{job_id}--{p}.hf.jobs" for p in kwargs["expose"] or []]
        return SimpleNamespace(id=job_id, url=f"https://huggingface.co/jobs/me/{job_id}",
                               status=SimpleNamespace(expose_urls=urls or None))

    def cancel_job(self, **kwargs):
        self.cancelled.append(kwargs["job_id"])


def test_hf_jobs_run_job_gets_exactly_the_blog_setup():
    fake = FakeJobs()
    launcher = HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload, cancel_job=fake.cancel_job,
                              environ={"HF_TOKEN": TOKEN})
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
            "volumes": [Volume(type="bucket", source="me/grpo-lora", mount_path="/lora", read_only=True)],
            "expose": [8000],
        }
    trainer = fake.calls[2]
    script = trainer.pop("command")
    assert trainer == {
        "image": "vllm/vllm-openai:v0.27.1", "env": {"PYTHONUNBUFFERED": "1", "HF_HOME": "/tmp/hf"},
        "secrets": {"HF_TOKEN": TOKEN}, "flavor": "h200", "timeout": "4h", "name": "blog-trainer",
        "labels": {"grpo-lab-run": "blog"},
        "volumes": [Volume(type="bucket", source="me/grpo-lora", mount_path="/lora", read_only=False)],
        "expose": None,
    }
    assert script[:2] == ["bash", "-c"]
    proxy_line = next(line for line in script[2].splitlines() if line.startswith("grpo-lab proxy"))
    assert proxy_line == ("grpo-lab proxy --host 127.0.0.1 --port 8000 "
                          f"--upstream https://{1:024x}--8000.hf.jobs "
                          f"--upstream https://{2:024x}--8000.hf.jobs --upstream-token-env HF_TOKEN &")
    assert "exec grpo-lab train-async --model Qwen/Qwen2.5-Math-1.5B --server-url " \
           "http://127.0.0.1:8000 --output-dir /lora/blog --lora-rank 1 --max-staleness 4" in script[2]
    assert launcher.urls == {"replica-0": f"https://{1:024x}--8000.hf.jobs",
                             "replica-1": f"https://{2:024x}--8000.hf.jobs"}
    assert TOKEN not in blog_plan().describe() + hf_jobs_commands(blog_plan())


def flag_values(command: list[str]) -> dict[str, str]:
    """`--flag value` pairs of an argv (store_true flags map to "")."""
    return {a: "" if i + 1 == len(command) or command[i + 1].startswith("--") else command[i + 1]
            for i, a in enumerate(command) if a.startswith("--")}


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
    with pytest.raises(ValueError, match=r"max_cpu_loras \(5\) must be >= max_staleness \+ 2 \(6\)"):
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
    assert "python3 -m grpo_lab.jobs.local wait-healthy" in plan["trainer"].command[2]


def test_hf_jobs_failed_submission_cancels_the_submitted_jobs():
    fake = FakeJobs(fail_at=3)
    launcher = HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload, cancel_job=fake.cancel_job,
                              environ={"HF_TOKEN": TOKEN})
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
    HfJobsLauncher(blog_plan(), run_job=fake.run_job, upload=fake.upload, environ={"HF_TOKEN": TOKEN}).submit()
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
        assert [options[i + 1] for i, o in enumerate(options) if o == "--secrets"] == list(call["secrets"])

    # and the real `hf` CLI parses such a line as intended (its --dry-run: offline, no token)
    hf = Path(PY).parent / "hf"
    if not hf.exists() and not shutil.which("hf"):
        return
    argv = recorded[2]
    argv = [*argv[:2], "--dry-run", *[a for a in argv[2:] if a != "--detach"]]
    out = subprocess.run([str(hf) if hf.exists() else "hf", *argv], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
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
    assert script.startswith("set -e\n" + wheel_install(f"/lora/blog/wheels/{wheel}", image_has_torch=True))
    assert (f"\nfor _ in $(seq 120); do test -f /lora/blog/wheels/{wheel} && break; sleep 5; done"
            f"\nfor attempt in $(seq 5); do\n  pip install --quiet --retries 5 "
            f"/lora/blog/wheels/{wheel} && break\n") in script  # the wheel alone: no extras
    # a CPU replica runs grpo-lab serve: it installs the same wheel from its read-only mount,
    # with torch's CPU build (the CPU image has no torch)
    cpu = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="cpu", replica_flavor="cpu-upgrade")
    assert cpu["replica-0"].command[2] == (
        "set -e\n" + wheel_install(f"/lora/cpu/wheels/{wheel}", image_has_torch=False) + "\nexec grpo-lab serve"
        + cpu["replica-0"].command[2].split("exec grpo-lab serve", 1)[1])
    assert f"--extra-index-url {CPU_TORCH_INDEX} /lora/cpu/wheels/{wheel}" in cpu["replica-0"].command[2]
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
    assert pip_calls[0] == f"install --quiet --retries 5 {wheel}"
    assert ("installed" in out.stdout) == (code == 0)


def test_the_trainer_device_and_training_follow_the_flavor(tmp_path):
    """GPU trainer: `--device cuda` and the blog's training; CPU: `--device cpu` and
    train-async's CPU-sized defaults; on HF Jobs the logs go to a local folder (the mount takes
    whole files); locally nothing changes."""
    def trainer_flags(plan):
        command = plan["trainer"].command
        argv = shlex.split(command[2].splitlines()[-1]) if command[:2] == ["bash", "-c"] else command
        return flag_values(argv)

    gpu = trainer_flags(blog_plan())
    assert gpu["--device"] == "cuda" and gpu["--local-dir"] == LOCAL_RUN_DIR
    # train-async takes every flag and every value (its configs validate at construction)
    argv = shlex.split(blog_plan()["trainer"].command[2].splitlines()[-1])[2:]
    args = build_parser().parse_args(argv)
    config = config_from_args(args, AsyncGRPOConfig)
    assert config_from_args(args, TrainAsyncJobConfig).local_dir == LOCAL_RUN_DIR
    assert (config.loss_type, config.weight_sync_steps, config.token_budget) == ("dapo", 4, 16384)
    assert {k: gpu[k] for k in ("--dataset", "--learning-rate", "--max-new-tokens",
                                "--weight-sync-steps")} == {
        "--dataset": "sail/Sanity-Test-R1D-1.5B", "--learning-rate": "4e-05",
        "--max-new-tokens": "3000", "--weight-sync-steps": "4"}
    assert trainer_flags(recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r",
                                     max_completion_length=512))["--max-new-tokens"] == "512"
    cpu = trainer_flags(recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name="r",
                                    trainer_flavor="cpu-upgrade"))
    assert cpu["--device"] == "cpu" and cpu["--local-dir"] == LOCAL_RUN_DIR
    assert not {"--dataset", "--learning-rate", "--max-new-tokens"} & set(cpu)
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
    newest checkpoint) and no --local-dir (the job rewrites its files whole); `kernels` (TRL's
    attention kernel) installed beside the wheel in the vLLM image."""
    from grpo_lab.jobs.trl_async_job import TrlAsyncJobConfig

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
        if script:
            assert "kernels" in script.split("pip install", 1)[1].splitlines()[0]
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


# --------------------------------------------------------------------------------- --preset blog

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
        actual = {"launch": launch, "trainer": trainer, "replicas": replica}[row["job"]][row["flag"]]
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
    assert "python3 -m grpo_lab.jobs.local wait-healthy" in plan["trainer"].command[2]
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
    assert {"grpo_lab/cli/main.py", "grpo_lab/cli/__main__.py", "grpo_lab/jobs/hf_jobs.py",
            "grpo_lab/serving/server.py"} <= names
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

