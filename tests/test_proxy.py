"""The proxy (grpo_lab.proxy.app): routing, batch splitting, broadcasts, health, stats, the CLI.

Every test runs stub replicas (tests/proxy_stubs.py) and an in-process proxy on 127.0.0.1 in one
event loop, under a hard time limit; one test starts `grpo-lab proxy` as a process.
Fault handling is in test_proxy_faults.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from proxy_stubs import StubReplica, fleet, run, wait_until

from grpo_lab.cli.flags import config_from_args, field_docs
from grpo_lab.cli.main import build_parser
from grpo_lab.proxy.config import ProxyConfig, start_proxy_process
from grpo_lab.proxy.router import pseudo_tokens

BS = 16
P1 = list(range(1000, 1000 + 3 * BS))  # three full blocks
P2 = list(range(2000, 2000 + 3 * BS))
P3 = list(range(3000, 3000 + 3 * BS))


def upstream(headers) -> str:
    return headers["X-Proxy-Upstream"]


def test_config_fields_documented_and_cli_flags():
    docs = field_docs(ProxyConfig)
    assert set(docs) == set(ProxyConfig.__dataclass_fields__)
    args = build_parser().parse_args([
        "proxy", "--upstream", "http://a:1/", "--upstream", "http://b:2", "--port", "9000",
        "--imbalance", "4", "--lora-retry-s", "0.5", "--upstream-token-env", "HF_TOKEN",
        "--routing", "round-robin"])
    cfg = config_from_args(args, ProxyConfig)
    assert cfg.upstreams == ["http://a:1", "http://b:2"]  # trailing slash dropped
    assert (cfg.port, cfg.imbalance, cfg.lora_retry_s, cfg.upstream_token_env) == (
        9000, 4, 0.5, "HF_TOKEN")
    assert cfg.routing == "round-robin" and ProxyConfig(["http://a:1"]).routing == "affinity"
    assert cfg.block_size == 16 and cfg.conn_limit == 1024 and cfg.lora_load_timeout_s == 300
    for bad, words in [({"upstreams": []}, "at least one"),
                       ({"upstreams": ["a:1"]}, "not an http"),
                       ({"upstreams": ["http://a:1", "http://a:1/"]}, "distinct"),
                       ({"upstreams": ["http://a:1"], "lora_retry_s": 0}, "lora_retry_s"),
                       ({"upstreams": ["http://a:1"], "routing": "random"}, "routing"),
                       ({"upstreams": ["http://a:1"], "event_loop": "tokio"}, "event_loop")]:
        with pytest.raises(ValueError, match=words):
            ProxyConfig(**bad)


def test_missing_token_variable_is_a_clear_error(monkeypatch):
    from grpo_lab.proxy.app import Proxy

    monkeypatch.delenv("GRPO_LAB_TEST_NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="GRPO_LAB_TEST_NO_SUCH_TOKEN"):
        Proxy(ProxyConfig(upstreams=["http://a:1"],
                          upstream_token_env="GRPO_LAB_TEST_NO_SUCH_TOKEN"))


def test_pseudo_tokens_cut_utf8_into_4_byte_chunks():
    assert len(pseudo_tokens("abcdefgh")) == 2
    assert len(pseudo_tokens("abcdefghi")) == 2  # the partial tail is dropped
    assert pseudo_tokens("é" * 4) == pseudo_tokens("é" * 4)[:2]  # 8 bytes -> 2 tokens
    a, b = pseudo_tokens("x" * 64 + "tail one"), pseudo_tokens("x" * 64 + "tail two")
    assert a[:16] == b[:16] and a != b  # a shared prefix gives shared leading pseudo-blocks


def test_single_prompt_routed_by_affinity_with_upstream_header():
    async def body():
        async with fleet(2) as f:
            s1, r1, h1 = await f.post("/v1/completions", {"prompt": P1, "model": "base", "n": 2})
            s2, r2, h2 = await f.post("/v1/completions", {"prompt": P1, "model": "base"})
            s3, r3, h3 = await f.post("/v1/completions", {"prompt": P2})
            assert (s1, s2, s3) == (200, 200, 200)
            assert upstream(h1) == upstream(h2) != upstream(h3)  # P1 stays, P2 goes elsewhere
            assert [c["index"] for c in r1["choices"]] == [0, 1]
            assert r1["choices"][0]["text"].startswith(f"r{f.stubs.index(_stub(f, h1))}|")
            stats = (await f.get("/proxy/stats"))[1]
            assert (stats["affinity"], stats["unmatched"], stats["spilled"]) == (1, 2, 0)
            assert stats["routed"] == [2, 1] and stats["inflight"] == [0, 0]
            assert stats["tracked_blocks"] == 6 and stats["completion_calls"] == 3
    run(body())


def _stub(f, headers) -> StubReplica:
    return next(s for s in f.stubs if s.url == upstream(headers))


def test_a_batch_is_split_per_prompt_and_merged_in_order():
    async def body():
        async with fleet(2) as f:
            _, _, h1 = await f.post("/v1/completions", {"prompt": P1})
            _, _, h2 = await f.post("/v1/completions", {"prompt": P2})
            assert upstream(h1) != upstream(h2)
            # P2 lives on one replica, P1 on the other: the batch must go to both
            status, out, headers = await f.post("/v1/completions",
                                                {"prompt": [P2, P1, P3], "n": 2})
            assert status == 200
            assert set(upstream(headers).split(",")) == {upstream(h1), upstream(h2)}
            assert [c["index"] for c in out["choices"]] == list(range(6))
            owners = {json.dumps(P1): _stub(f, h1).name, json.dumps(P2): _stub(f, h2).name}
            for k, prompt in enumerate([P2, P1, P3]):
                for j in range(2):
                    name, text, sample = out["choices"][2 * k + j]["text"].split("|")
                    assert text == json.dumps(prompt) and sample == str(j)
                    assert name == owners.get(text, name)  # affinity kept inside the batch
            assert out["usage"] == {"prompt_tokens": 3 * 48, "completion_tokens": 12,
                                    "total_tokens": 3 * 48 + 12}
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["split_batches"] == 1 and stats["affinity"] == 2
            # a batch of strings is split the same way
            long_a, long_b = "a" * 200, "b" * 200
            await f.post("/v1/completions", {"prompt": long_a})
            status, out, _ = await f.post("/v1/completions", {"prompt": [long_b, long_a]})
            assert status == 200 and [c["text"].split("|")[1] for c in out["choices"]] == [
                json.dumps(long_b), json.dumps(long_a)]
    run(body())


def test_text_and_chat_prompts_are_routed_on_pseudo_tokens():
    async def body():
        async with fleet(2) as f:
            system = "You are a careful math tutor. Think step by step. " * 3
            first = [await f.post("/v1/completions", {"prompt": system + "What is 2+2?"})
                     for _ in range(2)]
            assert upstream(first[0][2]) == upstream(first[1][2])
            chat = {"messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": "What is 3+4? " * 8}]}
            a = await f.post("/v1/chat/completions", chat)
            b = await f.post("/v1/chat/completions", chat)
            assert a[0] == b[0] == 200 and upstream(a[2]) == upstream(b[2])
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["affinity"] == 2 and stats["unmatched"] == 2
    run(body())


def test_authorization_is_stripped_and_the_token_sent_upstream():
    async def body():
        async with fleet(2, token="s3cret") as f:
            client = {"Authorization": "Bearer client-key"}
            await f.post("/v1/completions", {"prompt": P1}, headers=client)
            await f.post("/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": "/l/v1"},
                         headers=client)
            await f.post("/pause?mode=keep", headers=client)
            await f.get("/health", headers=client)
            seen = [auth for s in f.stubs for _, _, auth in s.seen]
            assert seen and set(seen) == {"Bearer s3cret"}
        async with fleet(1) as f:  # no token configured: no Authorization upstream at all
            await f.post("/v1/completions", {"prompt": P1},
                         headers={"Authorization": "Bearer client-key"})
            assert {auth for _, _, auth in f.stubs[0].seen} == {None}
    run(body())


def test_pause_resume_broadcast_and_health_needs_every_replica():
    async def body():
        async with fleet(3) as f:
            status, out, _ = await f.post("/pause?mode=keep")
            assert (status, out) == (200, {"status": "paused"})
            assert all(s.paused and ("POST", "/pause?mode=keep", None) in s.seen
                       for s in f.stubs)
            assert (await f.post("/resume"))[:2] == (200, {"status": "resumed"})
            assert not any(s.paused for s in f.stubs)
            assert (await f.get("/health"))[0] == 200
            f.stubs[2].health_status = 503
            status, out, _ = await f.get("/health")
            assert status == 503 and f.stubs[2].url in out["error"]["message"]
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["broadcasts"]["pause"] == 1 and stats["broadcasts"]["resume"] == 1
    run(body())


def test_reset_prefix_cache_reaches_every_replica():
    async def body():
        async with fleet(3) as f:
            status, _, _ = await f.post("/reset_prefix_cache")
            assert status == 200 and [s.cache_resets for s in f.stubs] == [1, 1, 1]
            assert (await f.get("/proxy/stats"))[1]["broadcasts"]["reset_prefix_cache"] == 1
    run(body())


def test_server_info_and_models_come_from_one_replica_as_one_server():
    async def body():
        async with fleet(2) as f:
            status, info, headers = await f.get("/server_info?config_format=json")
            assert status == 200 and info["vllm_config"]["parallel_config"][
                "data_parallel_size"] == 1  # the stubs say 2: the proxy is one server
            assert info["vllm_config"]["lora_config"]["max_loras"] == 6
            await f.post("/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": "/l/v1"})
            status, models, _ = await f.get("/v1/models")
            assert status == 200 and [m["id"] for m in models["data"]] == ["base", "v1"]
            f.stubs[0].health_hang = True  # the first replica goes quiet: the other answers
            f.stubs[0].completion_mode = "hang"
            await wait_until(lambda: f.stubs[0].url in f.proxy.replicas.down_reasons,
                             what="the quiet replica out of routing")
            status, info, headers = await f.get("/server_info?config_format=json")
            assert status == 200 and upstream(headers) == f.stubs[1].url
    run(body())


def test_load_is_retried_while_a_mount_lags_then_unload_everywhere():
    async def body():
        async with fleet(3) as f:
            f.stubs[1].not_visible_for = 3  # its mount sees the directory on the 4th try
            status, text, _ = await f.post("/v1/load_lora_adapter",
                                           {"lora_name": "policy-v1", "lora_path": "/lora/v1"})
            assert status == 200 and text == "Success: LoRA adapter 'policy-v1' added successfully."
            assert f.holders("policy-v1") == 3
            assert f.stubs[1].load_attempts["policy-v1"] == 4
            status, out, _ = await f.post("/v1/completions", {"prompt": P1, "model": "policy-v1"})
            assert status == 200
            # loading it again from the same path: every replica has it -> 200, nothing changes
            status, out, _ = await f.post("/v1/load_lora_adapter",
                                          {"lora_name": "policy-v1", "lora_path": "/lora/v1"})
            assert status == 200 and "already loaded from /lora/v1" in out
            assert f.holders("policy-v1") == 3
            status, text, _ = await f.post("/v1/unload_lora_adapter", {"lora_name": "policy-v1"})
            assert status == 200 and "removed successfully" in text and f.holders("policy-v1") == 0
            status, out, _ = await f.post("/v1/unload_lora_adapter", {"lora_name": "policy-v1"})
            assert status == 404 and out["error"]["type"] == "NotFoundError"
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["retries"] == 3 and stats["rollbacks"] == 0
            assert stats["broadcasts"]["load_lora_adapter"] == 2
            assert stats["broadcasts"]["unload_lora_adapter"] == 2
    run(body())


def test_known_paths_with_another_method_answer_like_fastapi():
    async def body():
        async with fleet(1) as f:
            assert (await f.get("/v1/completions"))[:2] == (405, {"detail": "Method Not Allowed"})
            assert (await f.post("/get_world_size"))[:2] == (405, {"detail": "Method Not Allowed"})
            # a route neither the proxy nor the replica has: the replica's own 404
            status, _, headers = await f.get("/v1/embeddings")
            assert status == 404 and upstream(headers) == f.stubs[0].url
            stats = (await f.get("/proxy/stats"))[1]
            assert stats["errors"]["not_found"] == 0 and stats["forwarded"] == 1
    run(body())


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_proxy_process_from_the_cli(tmp_path, event_loop):
    """`grpo-lab proxy` as a separate process, started and stopped by `start_proxy_process`, on
    either event loop."""

    async def body():
        stubs = [await StubReplica(f"r{i}").start() for i in range(2)]
        loop = asyncio.get_running_loop()
        proxy = None
        try:
            proxy = await loop.run_in_executor(None, lambda: start_proxy_process(
                [s.url for s in stubs], env={"GRPO_LAB_TEST_TOKEN": "tok"},
                upstream_token_env="GRPO_LAB_TEST_TOKEN", health_interval_s=0.1,
                event_loop=event_loop, log_path=tmp_path / "proxy.log"))
            import aiohttp

            async with aiohttp.ClientSession() as session:
                async with session.post(proxy.url + "/v1/completions",
                                        json={"prompt": P1}) as reply:
                    assert reply.status == 200
                    assert reply.headers["X-Proxy-Upstream"] in [s.url for s in stubs]
                async with session.get(proxy.url + "/proxy/stats") as reply:
                    assert (await reply.json())["requests"] == 1
            assert {a for s in stubs for m, p, a in s.seen if p == "/v1/completions"} == {
                "Bearer tok"}
        finally:
            if proxy is not None:
                await loop.run_in_executor(None, proxy.stop)
            for s in stubs:
                await s.stop()
        assert proxy.proc.returncode is not None  # stopped, not left running
        ready = next(line for line in proxy.log_text().splitlines()
                     if line.startswith("GRPO_LAB_PROXY_READY"))
        assert ready.endswith(f"event_loop={event_loop}")

    run(body(), timeout_s=120)


def test_a_streamed_request_passes_through_from_one_replica():
    async def body():
        async with fleet(2) as f:
            status, text, headers = await f.post("/v1/completions",
                                                 {"prompt": [P1, P2], "stream": True})
            assert status == 200 and headers["Content-Type"] == "text/event-stream"
            assert upstream(headers) in [s.url for s in f.stubs]  # one replica, not split
            events = [e for e in text.split("\n\n") if e]
            assert len(events) == 4 and events[-1] == "data: [DONE]"
            assert (await f.get("/proxy/stats"))[1]["inflight"] == [0, 0]
    run(body())


class FakeTokenizer:
    """Token ids = character codes; a chat template that joins role and content."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))


def test_routing_keys_with_and_without_a_tokenizer():
    from grpo_lab.proxy.router import routing_keys
    from grpo_lab.serve.protocol import RequestError

    tok = FakeTokenizer()
    assert routing_keys({"prompt": [5, 6]}, False, tok) == ([[5, 6]], [[5, 6]])
    assert routing_keys({"prompt": "ab", "add_special_tokens": False}, False, tok)[1] == [
        [97, 98]]
    prompts, keys = routing_keys({"prompt": ["ab", "c"]}, False, tok)
    assert prompts == ["ab", "c"] and keys == [[1, 97, 98], [1, 99]]
    messages = [{"role": "user", "content": "hi"}]
    assert routing_keys({"messages": messages}, True, tok)[1] == [tok.encode("<user>hi")]
    # without a tokenizer: 4-byte pseudo-tokens of the text (chat: of the sorted JSON)
    assert routing_keys({"prompt": "abcdefgh"}, False)[1] == [pseudo_tokens("abcdefgh")]
    assert routing_keys({"messages": messages}, True)[1] == [
        pseudo_tokens(json.dumps(messages, sort_keys=True))]
    with pytest.raises(RequestError, match="Field required: 'messages'"):
        routing_keys({"messages": []}, True, tok)
    # the server's prompt rules (protocol.parse_prompts): a bool is not a token id
    with pytest.raises(RequestError, match="'prompt' must be") as info:
        routing_keys({"prompt": [1, True]}, False)
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_the_tokenizer_flag_loads_a_real_tokenizer(tiny_model_dir):
    from grpo_lab.proxy.app import Proxy

    proxy = Proxy(ProxyConfig(upstreams=["http://a:1"], tokenizer=str(tiny_model_dir)))
    assert proxy.tokenizer.encode("12+34=", add_special_tokens=True)[1:] == \
        proxy.tokenizer.encode("12+34=", add_special_tokens=False)
