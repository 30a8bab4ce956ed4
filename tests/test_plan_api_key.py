"""The run plan hands the proxy's API key to the proxy and the trainer as a secret (issue 23):
by the name VLLM_API_KEY, never its value, never in a command line."""

from __future__ import annotations

from grpo_lab.jobs.plan import recipe_plan


def test_the_api_key_travels_as_a_secret_never_in_argv(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret-value")
    plans = [recipe_plan(bucket=str(tmp_path / "bucket"), run_name="r1"),
             recipe_plan(backend="hf-jobs", bucket="hf://buckets/me/b", run_name="r2",
                         replica_flavor="cpu-basic", trainer_flavor="cpu-basic",
                         install="pip install grpo-lab")]
    for plan in plans:
        for job in plan.jobs:
            assert "s3cret-value" not in " ".join(job.command) + str(job.env), job.name
        trainer = plan["trainer"]
        assert "VLLM_API_KEY" in trainer.secrets
        assert "--api-key-env VLLM_API_KEY" in " ".join(trainer.command)
    assert "VLLM_API_KEY" in plans[0]["proxy"].secrets  # locally the proxy is a job of its own
    monkeypatch.delenv("VLLM_API_KEY")
    plan = recipe_plan(bucket=str(tmp_path / "bucket"), run_name="r3")
    assert "--api-key-env" not in plan["trainer"].command and not plan["trainer"].secrets
