"""The recipe's plan: its jobs, their commands and flags, checked as data and run locally."""

from __future__ import annotations

import json
import shlex
import urllib.request

import pytest
from launcher_helpers import assert_no_orphans

from grpo_lab.cli.flags import field_docs
from grpo_lab.launch.local import LocalLauncher
from grpo_lab.launch.recipe_plan import (
    RecipeConfig,
    recipe_plan,
)
from grpo_lab.launch.specs import (
    BucketMount,
    JobSpec,
    RunPlan,
)
from grpo_lab.watch.live_stats import proxy_stats, router_counters


def test_local_recipe_plan(tmp_path):
    plan = recipe_plan(bucket=str(tmp_path / "bucket"), run_name="r1")
    assert plan.names == ["replica-0", "replica-1", "proxy", "trainer"]
    assert [[j.name for j in w] for w in plan.waves()] == [["replica-0", "replica-1"], ["proxy"],
                                                          ["trainer"]]
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
    assert proxy[3:4] == ["proxy"]
    assert [proxy[i + 1] for i, a in enumerate(proxy) if a == "--upstream"] == upstreams
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
        RunPlan([JobSpec(name="t", command=["x"], depends_on=["r"]),
                 JobSpec(name="r", command=["x"])])
    with pytest.raises(ValueError, match="HF Jobs need a Storage Bucket"):
        recipe_plan(backend="hf-jobs")
    with pytest.raises(ValueError, match="absolute"):
        BucketMount("hf://buckets/me/b", "lora")
