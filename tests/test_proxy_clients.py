"""The proxy as TRL's and vLLM's clients see it (grpo_lab.proxy): other routes passed through,
/get_world_size, /ping, /reset_prefix_cache, "already loaded" only for the same adapter, and the
mark-down defaults for remote upstreams. Stub replicas (tests/proxy_stubs.py), in one event loop.
"""

from __future__ import annotations

import asyncio

import pytest
from proxy_stubs import fleet, run

from grpo_lab.proxy.config import (
    LOCAL_HEALTH_FAILURES,
    LOCAL_HEALTH_TIMEOUT_S,
    REMOTE_HEALTH_FAILURES,
    REMOTE_HEALTH_TIMEOUT_S,
    ProxyConfig,
    is_loopback,
)

LOAD = "/v1/load_lora_adapter"


def test_other_routes_pass_through_to_one_replica_in_turn():
    async def body():
        async with fleet(2, token="secret") as f:
            answers = []
            for _ in range(4):
                status, out, headers = await f.post(  # a read-only POST route
                    "/tokenize?x=1&y=2", {"hello": "world"},
                    headers={"X-Client": "trl", "Authorization": "Bearer client-key"})
                assert status == 201  # the replica's status, body and headers, unchanged
                assert headers["X-Replica-Says"] == f"hello from {out['replica']}"
                assert headers["X-Proxy-Upstream"] == f.stubs[int(out["replica"][1])].url
                assert (out["method"], out["path_qs"]) == ("POST", "/tokenize?x=1&y=2")
                assert out["body"] == '{"hello": "world"}' and out["x_client"] == "trl"
                answers.append(out["replica"])
            assert sorted(answers) == ["r0", "r0", "r1", "r1"]  # replicas in turn
            status, out, _ = await f.request("GET", "/v1/other")  # any GET is read-only
            assert status == 201 and out["method"] == "GET"
            for stub in f.stubs:  # the client's key is dropped, the proxy's token is sent
                sent = {auth for method, path, auth in stub.seen
                        if path.startswith(("/v1/other", "/tokenize"))}
                assert sent == {"Bearer secret"}
            assert (await f.get("/proxy/stats"))[1]["forwarded"] == 5
    run(body())


def test_other_routes_skip_a_replica_that_is_down_and_503_when_none_is_up():
    async def body():
        async with fleet(2) as f:
            f.stubs[0].health_status = 503
            for _ in range(100):
                if f.proxy.replicas.down_reasons:
                    break
                await asyncio.sleep(0.02)
            replicas = {(await f.get("/v1/other"))[1]["replica"] for _ in range(3)}
            assert replicas == {"r1"}
            f.stubs[1].health_status = 503
            for _ in range(100):
                if len(f.proxy.replicas.down_reasons) == 2:
                    break
                await asyncio.sleep(0.02)
            status, out, _ = await f.get("/v1/other")
            assert status == 503 and "no replica is up" in out["error"]["message"]
    run(body())


def test_world_size_ping_and_weight_transfer_routes():
    async def body():
        async with fleet(2) as f:
            status, out, _ = await f.get("/get_world_size")
            assert (status, out) == (200, {"world_size": 1})  # what TRL's client reads
            assert (await f.get("/ping"))[0] == 200 and (await f.post("/ping"))[0] == 200
            f.stubs[1].health_status = 503
            status, out, _ = await f.get("/ping")
            assert status == 503 and f.stubs[1].url in out["error"]["message"]
            status, out, _ = await f.post("/init_weight_transfer_engine", {"init_info": {}})
            assert status == 400 and "load_lora_adapter" in out["error"]["message"]
            assert not any(p.startswith("/init_weight") for s in f.stubs for _, p, _ in s.seen)
    run(body())



def test_already_loaded_from_the_same_path_is_success():
    async def body():
        async with fleet(2) as f:
            f.stubs[0].adapters["trl-policy-v2"] = "/bucket/trl-policy-v2/"  # vLLM kept a slash
            status, text, _ = await f.post(LOAD, {"lora_name": "trl-policy-v2",
                                                  "lora_path": "/bucket/trl-policy-v2"})
            assert status == 200 and f.holders("trl-policy-v2") == 2
            assert (await f.get("/proxy/stats"))[1]["rollbacks"] == 0
    run(body())


def test_already_loaded_from_another_path_fails_and_rolls_the_load_back():
    """A replica that kept an older adapter under the name being published would serve it: the
    load fails with 400 and the replicas that took the new one unload it again."""
    async def body():
        async with fleet(3) as f:
            f.stubs[1].adapters["policy-v3"] = "/old-run/policy-v3"
            status, out, _ = await f.post(LOAD, {"lora_name": "policy-v3",
                                                 "lora_path": "/bucket/policy-v3"})
            message = out["error"]["message"]
            assert status == 400 and "/old-run/policy-v3" in message and "rolled back" in message
            assert [s.adapters.get("policy-v3") for s in f.stubs] == [
                None, "/old-run/policy-v3", None]  # as before the call
            assert (await f.get("/proxy/stats"))[1]["rollbacks"] == 1
    run(body())


def test_mark_down_defaults_follow_the_upstreams():
    local = ProxyConfig(upstreams=["http://127.0.0.1:8000", "http://localhost:8001",
                                   "http://[::1]:8002"])
    assert (local.health_failures, local.health_timeout_s) == (LOCAL_HEALTH_FAILURES,
                                                                LOCAL_HEALTH_TIMEOUT_S) == (2, 5.0)
    remote = ProxyConfig(upstreams=["http://127.0.0.1:8000",
                                    "https://someone-replica-0.hf.space"])
    assert (remote.health_failures, remote.health_timeout_s) == (REMOTE_HEALTH_FAILURES,
                                                                 REMOTE_HEALTH_TIMEOUT_S)
    assert remote.health_failures > local.health_failures
    assert remote.health_timeout_s > local.health_timeout_s
    chosen = ProxyConfig(upstreams=["http://10.0.0.2:8000"], health_failures=3,
                         health_timeout_s=7)
    assert (chosen.health_failures, chosen.health_timeout_s) == (3, 7)
    assert [is_loopback(u) for u in ("http://127.0.0.5:1", "http://10.0.0.2:1",
                                     "http://example.com")] == [True, False, False]
    with pytest.raises(ValueError, match="health_failures"):
        ProxyConfig(upstreams=["http://10.0.0.2:8000"], health_failures=0)
