"""The proxy under hostile input and partial faults (issue 23): it lets no one in without the
key, relays only what it can apply to the whole fleet, keeps a returning replica in step with
the fleet, undoes a failed in-place load, and survives one refused connection.

Stub replicas (tests/proxy_stubs.py), an in-process proxy, every body under a hard time limit.
"""

from __future__ import annotations

import asyncio

from proxy_stubs import fleet, run, wait_until

from grpo_lab.proxy.http_pool import ConnectFailed

BS = 16
P1 = list(range(1000, 1000 + 3 * BS))
LOAD = "/v1/load_lora_adapter"


async def raw_request(url: str, head: bytes) -> bytes:
    """Send raw HTTP bytes (headers aiohttp's client would refuse to send) -> the raw answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


def test_the_api_key_guards_every_route_but_health(monkeypatch):
    async def body():
        async with fleet(2, api_key="k3y") as f:
            good = {"Authorization": "Bearer k3y"}
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
                for method, path in (("POST", "/v1/completions"), ("POST", "/pause"),
                                     ("GET", "/v1/models"), ("GET", "/proxy/stats"),
                                     ("POST", LOAD), ("GET", "/v1/other")):
                    status, out, _ = await f.request(method, path, {"prompt": P1},
                                                     headers=headers)
                    assert (status, out) == (401, {"error": "Unauthorized"}), (method, path)
            assert not any(p != "/health" for s in f.stubs for _, p, _ in s.seen)
            assert (await f.get("/health"))[0] == 200  # open, as vLLM's
            # bytes that are not UTF-8: a 401, never a 500
            answer = await raw_request(f.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                       b"Authorization: Bearer \xff\xfek3y\r\n"
                                       b"Connection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 401"), answer[:100]
            status, out, h = await f.post("/v1/completions", {"prompt": P1}, headers=good)
            assert status == 200 and h["X-Proxy-Upstream"]
            stats = (await f.get("/proxy/stats", headers=good))[1]
            assert stats["errors"]["unauthorized"] == 19
            # the client's key never goes upstream
            assert {a for s in f.stubs for _, p, a in s.seen if p == "/v1/completions"} == {None}
        monkeypatch.setenv("VLLM_API_KEY", "from-env")  # as vllm serve: the key from the env
        async with fleet(1) as f:
            assert (await f.get("/v1/models"))[0] == 401
            assert (await f.get("/v1/models",
                                headers={"Authorization": "Bearer from-env"}))[0] == 200
    run(body())


def test_routes_that_change_one_replicas_state_are_refused():
    async def body():
        async with fleet(2) as f:
            refused = ["/sleep", "/sleep/", "//sleep", "/wake_up", "/wake_up?tags=weights",
                       "/collective_rpc", "/scale_elastic_ep", "/update_weights",
                       "/update_weights/", "/init_weight_transfer_engine/", "/v1/state",
                       "/pause/", "/v1/load_lora_adapter/"]
            for path in refused:
                status, out, _ = await f.post(path, {"method": "x"})
                assert status == 400 and out["error"]["type"] == "BadRequestError", (path, out)
                assert "replica" in out["error"]["message"], out
            for method in ("PUT", "DELETE", "PATCH"):
                status, _, _ = await f.request(method, "/v1/other")
                assert status == 400, method
            status, out, _ = await f.get("/sleep")  # a refused route is refused for every method
            assert status == 400
            relayed = [p for s in f.stubs for _, p, _ in s.seen if p != "/health"]
            assert relayed == [], relayed
            # read-only routes go to one replica
            assert (await f.post("/tokenize", {"prompt": "hi"}))[0] == 201
            assert (await f.get("/v1/other"))[0] == 201
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["errors"]["refused"] == len(refused) + 4 and stats["forwarded"] == 2
    run(body())


def test_malformed_json_nested_too_deeply_is_400():
    async def body():
        async with fleet(1) as f:
            deep = b"[" * 100_000 + b"]" * 100_000
            for path in ("/v1/completions", "/v1/chat/completions", LOAD,
                         "/v1/unload_lora_adapter"):
                status, out, _ = await f.post(path, data=deep)
                assert status == 400 and "Invalid JSON body" in out["error"]["message"], path
            status, out, _ = await f.post("/v1/completions", data=b'{"prompt": ' + deep + b"}")
            assert status == 400
            assert (await f.post("/v1/completions", {"prompt": P1}))[0] == 200
    run(body())


def test_a_returning_replica_is_brought_to_the_fleets_pause_state():
    async def body():
        async with fleet(2, health_failures=1) as f:
            away = f.stubs[1]
            assert (await f.post("/pause?mode=keep"))[0] == 200
            away.health_status = 503
            await wait_until(lambda: away.url in f.proxy.replicas.down_reasons)
            away.paused, away.health_status = False, 200  # it restarted: running, not paused
            await wait_until(lambda: not f.proxy.replicas.down_reasons)
            assert away.paused and ("POST", "/pause?mode=keep", None) in away.seen[-3:]
            # away again; the fleet resumes meanwhile; it comes back still paused
            away.health_status = 503
            await wait_until(lambda: away.url in f.proxy.replicas.down_reasons)
            assert (await f.post("/resume"))[0] == 200
            assert not f.stubs[0].paused and away.paused
            away.health_status = 200
            await wait_until(lambda: not f.proxy.replicas.down_reasons)
            assert not away.paused
            assert (await f.get("/proxy/stats"))[1]["paused"] == "/resume"
    run(body())


def test_a_failed_in_place_load_restores_the_previous_adapter():
    async def body():
        async with fleet(3) as f:
            load = {"lora_name": "policy", "lora_path": "/l/a"}
            assert (await f.post(LOAD, load))[0] == 200
            f.stubs[2].load_mode = "fail"
            status, out, _ = await f.post(LOAD, {"lora_name": "policy", "lora_path": "/l/b",
                                                 "load_inplace": True})
            assert status == 500 and "rolled back" in out["error"]["message"]
            # every replica serves the previous adapter again, none lost the name
            assert [s.adapters.get("policy") for s in f.stubs] == ["/l/a"] * 3
            f.stubs[2].load_mode = "ok"
            status, _, _ = await f.post(LOAD, {"lora_name": "policy", "lora_path": "/l/b",
                                               "load_inplace": True})
            assert status == 200 and [s.adapters["policy"] for s in f.stubs] == ["/l/b"] * 3
            # a name that did not exist before: the rollback unloads it
            f.stubs[0].load_mode = "fail"
            status, _, _ = await f.post(LOAD, {"lora_name": "new", "lora_path": "/l/n",
                                               "load_inplace": True})
            assert status == 500 and f.holders("new") == 0
    run(body())


def test_one_refused_connection_is_not_a_death():
    async def body():
        async with fleet(2, health_failures=3, health_interval_s=60) as f:
            _, _, h = await f.post("/v1/completions", {"prompt": P1})
            target = next(s for s in f.stubs if s.url == h["X-Proxy-Upstream"])
            other = next(s for s in f.stubs if s is not target)
            pool = f.proxy.replicas.pool
            real_post, refuse = pool.post, [0]

            async def flaky_post(url, data, timeout_s):
                if url.startswith(target.url) and refuse[0]:
                    refuse[0] -= 1
                    raise ConnectFailed("simulated: connection refused")
                return await real_post(url, data, timeout_s)

            pool.post = flaky_post

            def completions_on_target() -> int:
                return sum(path == "/v1/completions" for _, path, _ in target.seen)

            before = completions_on_target()
            target.completion_gate = asyncio.Event()  # held on target until the gate opens
            slow = asyncio.ensure_future(f.post("/v1/completions", {"prompt": P1}))
            await wait_until(lambda: completions_on_target() == before + 1,
                             what="the request in flight on target")
            refuse[0] = 1
            status, _, h = await f.post("/v1/completions", {"prompt": P1})
            assert status == 200 and h["X-Proxy-Upstream"] == other.url  # sent elsewhere
            assert refuse[0] == 0 and not slow.done()  # refused once, while `slow` was in flight
            target.completion_gate.set()
            status, _, h = await slow
            assert status == 200 and h["X-Proxy-Upstream"] == target.url  # not cancelled
            assert f.proxy.replicas.down_reasons == {}
            target.completion_gate = None
            # health_failures refusals in a row do take it out
            refuse[0] = 3
            for i in range(3):
                status, _, h = await f.post("/v1/completions", {"prompt": P1})
                assert status == 200 and h["X-Proxy-Upstream"] == other.url
                assert (target.url in f.proxy.replicas.down_reasons) == (i == 2)
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["marked_down"] == 1 and stats["rerouted"] == 4
    run(body())
