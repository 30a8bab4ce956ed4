"""The trainer job checks that the replicas serve its base model (issue 33, item 4): model cards
from fake servers on 127.0.0.1, a fake proxy in front of them, and how names are compared."""

from __future__ import annotations

import pytest
from fake_http import FakeServer

from grpo_lab.rollout.http_generator import check_replicas, serves_model

HUB = "Qwen/Qwen3-0.6B"


def models(base: str, root: str | None = None, adapters=()) -> dict:
    """A /v1/models answer as vLLM writes it: the base card, then one card per adapter."""
    cards = [{"id": base, "object": "model", "root": root or base, "parent": None}]
    cards += [{"id": a, "object": "model", "root": f"/lora/{a}", "parent": base}
              for a in adapters]
    return {"object": "list", "data": cards}


def test_names_compared_as_vllm_and_grpo_lab_serve_write_them(tmp_path):
    # vLLM: id = --served-model-name or the model as given, root = the model as given.
    assert serves_model({"id": HUB, "root": HUB}, HUB)
    assert serves_model({"id": "policy", "root": HUB}, HUB)
    assert not serves_model({"id": "Qwen/Qwen3-1.7B", "root": "Qwen/Qwen3-1.7B"}, HUB)
    # A local folder: by its real path, however it was written; a hub cache snapshot: its id.
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert serves_model({"id": "m", "root": str(folder) + "/"}, str(tmp_path / "." / "my-model"))
    snapshot = "/data/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123"
    assert serves_model({"id": snapshot, "root": snapshot}, HUB)
    # grpo_lab's built models (`grpo-lab serve tiny`: id "tiny", root its cache folder) are
    # their recipe's folder name, whichever machine's cache holds them.
    card = {"id": "tiny", "root": "/root/.cache/grpo_lab/models/tiny-add2-abc"}
    assert serves_model(card, "tiny", "/home/me/.cache/grpo_lab/models/tiny-add2-abc")
    assert not serves_model(card, "tiny", "/home/me/.cache/grpo_lab/models/tiny-sort4-def")


def test_one_server_serving_the_base_model_passes():
    with FakeServer({"/v1/models": models(HUB, adapters=["policy-v0"])}) as server:
        cards, unreachable = check_replicas(server.url, HUB, timeout_s=5)
    assert cards == {server.url: models(HUB)["data"][0]} and unreachable == {}


def test_a_replica_behind_the_proxy_with_another_model_is_refused_by_name():
    with FakeServer({"/v1/models": models(HUB)}) as good, \
            FakeServer({"/v1/models": models("Qwen/Qwen3-1.7B")}) as bad:
        routes = {"/v1/models": models(HUB), "/proxy/stats": {"upstreams": [good.url, bad.url]}}
        with FakeServer(routes, headers={"X-Proxy-Upstream": good.url}) as proxy:
            with pytest.raises(ValueError) as error:
                check_replicas(proxy.url, HUB, api_key="k", timeout_s=5)
    message = str(error.value)
    assert f"{bad.url} serves 'Qwen/Qwen3-1.7B'" in message and good.url not in message
    assert repr(HUB) in message
    # Each replica was asked directly, with the servers' bearer token.
    assert [r[1] for r in bad.requests] == ["/v1/models"]
    assert bad.requests[0][3]["Authorization"] == "Bearer k"
    assert [r[1] for r in good.requests] == []  # the proxy already answered from it


def test_a_replica_that_cannot_be_asked_is_reported_not_guessed():
    with FakeServer({"/v1/models": models(HUB)}) as good:
        gone = "http://127.0.0.1:9"  # nothing listens there
        routes = {"/v1/models": models(HUB), "/proxy/stats": {"upstreams": [good.url, gone]}}
        with FakeServer(routes, headers={"X-Proxy-Upstream": good.url}) as proxy:
            cards, unreachable = check_replicas(proxy.url, HUB, timeout_s=5)
    assert list(cards) == [good.url] and list(unreachable) == [gone]


def test_an_injected_fetch_and_a_server_that_does_not_answer():
    answers = {"http://s/v1/models": (models("other"), {})}

    def fetch(url):
        if url not in answers:
            raise OSError(f"404 {url}")
        return answers[url]

    with pytest.raises(ValueError, match=r"http://s serves 'other' \(root 'other'\)"):
        check_replicas("http://s/", HUB, fetch=fetch)
    with pytest.raises(ValueError, match="cannot ask http://127.0.0.1:9/v1/models"):
        check_replicas("http://127.0.0.1:9", HUB, timeout_s=2)


def test_grpo_lab_serve_tiny_is_the_trainers_tiny(server_process):
    """`grpo-lab serve tiny`'s card (id "tiny", root its cache folder) against the folder the
    trainer resolves `tiny` to for its task."""
    from grpo_lab.train.config import GRPOConfig
    from grpo_lab.train.trainer import resolve_model_path

    server = server_process()
    path = resolve_model_path(GRPOConfig(progress=False))
    cards, _ = check_replicas(server.url, "tiny", str(path), timeout_s=10)
    assert cards[server.url]["id"] == "tiny"
    with pytest.raises(ValueError, match=f"{server.url} serves 'tiny'"):  # another task's tiny
        check_replicas(server.url, "tiny", str(path.parent / "tiny-other-recipe"), timeout_s=10)
    with pytest.raises(ValueError, match=f"{server.url} serves 'tiny'"):
        check_replicas(server.url, HUB, timeout_s=10)


def test_the_train_async_job_refuses_before_it_writes_anything(tmp_path):
    from grpo_lab.cli.flags import config_from_args
    from grpo_lab.cli.main import build_parser
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_job import TrainAsyncJobConfig, check_base_model

    config = AsyncGRPOConfig(model=HUB, output_dir=str(tmp_path / "run"))
    with FakeServer({"/v1/models": models("Qwen/Qwen3-1.7B")}) as server:
        with pytest.raises(ValueError, match="serves 'Qwen/Qwen3-1.7B'"):
            check_base_model(config, TrainAsyncJobConfig(server_url=server.url))
        args = build_parser().parse_args(["train-async", "--server-url", server.url,
                                          "--check-base-model", "false"])
        job = config_from_args(args, TrainAsyncJobConfig)
        check_base_model(config, job)  # skipped: no more requests
    assert [r[1] for r in server.requests] == ["/v1/models", "/proxy/stats"]  # not the proxy
    assert not (tmp_path / "run").exists()


def test_the_base_model_check_builds_no_model(tmp_path, monkeypatch):
    """`grpo-lab train-async`'s check names grpo_lab's models by their cache folder, worked out
    from the recipe: a task whose tiny model is not cached is not built for it (issue 45)."""
    from grpo_lab.model.models import made_model_folder_name
    from grpo_lab.model.tiny_model import TinyModelRecipe

    monkeypatch.setenv("GRPO_LAB_HOME", str(tmp_path))  # an empty cache
    name = made_model_folder_name("tiny", task="sort", difficulty=5)
    assert name == TinyModelRecipe(task="sort", difficulty=5).key()
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    assert made_model_folder_name("Qwen/Qwen2.5-0.5B-Instruct") is None
