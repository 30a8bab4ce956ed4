"""The run plan hands the proxy's API key to the proxy and the trainer as a secret (issue 23):
by the name VLLM_API_KEY, never its value, never in a command line."""

from __future__ import annotations

from grpo_lab.launch.recipe_plan import recipe_plan


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


def test_a_server_started_with_a_key_has_none_in_its_argv(server_process):
    """start_server_process(api_key=...) hands the key over as $VLLM_API_KEY (as vLLM reads it):
    a command line is visible to every user of the machine (`ps`)."""
    import urllib.error
    import urllib.request
    from pathlib import Path

    server = server_process(api_key="s3cret-key")
    argv = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert argv and not any(b"s3cret-key" in arg for arg in argv), argv
    try:  # and the key is still required
        urllib.request.urlopen(server.url + "/v1/models", timeout=10)
        raise AssertionError("the server answered without the key")
    except urllib.error.HTTPError as refused:
        assert refused.code == 401
    asked = urllib.request.Request(server.url + "/v1/models",
                                   headers={"Authorization": "Bearer s3cret-key"})
    with urllib.request.urlopen(asked, timeout=10) as answer:
        assert answer.status == 200
    # the proxy in front of it, started with a key of its own: none in its argv either
    from grpo_lab.proxy.config import start_proxy_process

    with start_proxy_process([server.url], api_key="pr0xy-key", upstream_token_env="UP_KEY",
                             env={"UP_KEY": "s3cret-key"}) as proxy:
        argv = Path(f"/proc/{proxy.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert argv and not any(b"pr0xy-key" in a or b"s3cret-key" in a for a in argv), argv
        try:
            urllib.request.urlopen(proxy.url + "/v1/models", timeout=10)
            raise AssertionError("the proxy answered without its key")
        except urllib.error.HTTPError as refused:
            assert refused.code == 401
