"""The prefix cache (grpo_lab.serve.prefix_cache): its bookkeeping on fake blocks, then the
engine and `grpo-lab serve` with it on, against the same engine with it off."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from grpo_lab.serve.batch import Sequence, make_generator
from grpo_lab.serve.block_hashes import chained_block_hashes
from grpo_lab.serve.config import ServeConfig
from grpo_lab.serve.engine import Engine, generate_sync
from grpo_lab.serve.lora_registry import LoRARegistry, read_adapter
from grpo_lab.serve.prefix_cache import PrefixCache
from grpo_lab.serve.sampling import SamplingParams

torch.set_num_threads(1)
BS = 4  # a small block size for the bookkeeping tests


def fake_blocks(n: int, value: float = 0.0) -> list[torch.Tensor]:
    """n blocks of a 2-layer model with 1 KV head of size 2."""
    return [torch.full((2, 2, 1, BS, 2), value + i) for i in range(n)]


def fill(cache: PrefixCache, prompt: list[int], namespace: str = "", adapter_id: int = 0):
    found = cache.match(prompt, namespace, adapter_id)
    cache.insert(found, fake_blocks(len(found.hashes) - len(found.blocks)))
    return found


def cached_blocks(cache: PrefixCache, prompt, namespace: str = "", adapter_id: int = 0) -> int:
    return len(cache.match(prompt, namespace, adapter_id).blocks)


# ------------------------------------------------------------------ bookkeeping


def test_the_router_and_the_cache_hash_blocks_alike():
    from grpo_lab.proxy.router import PrefixRouter, RouterConfig

    ids = list(range(40))
    router = PrefixRouter(2, RouterConfig(block_size=BS))
    assert router.block_hashes(ids, "policy-v3") == chained_block_hashes(ids, "policy-v3", BS)
    assert PrefixCache(BS).match(ids, "policy-v3").hashes == router.block_hashes(ids, "policy-v3")


def test_miss_then_hit_counted_in_tokens():
    cache = PrefixCache(block_size=BS, max_blocks=100)
    prompt = list(range(10))  # two full blocks and a tail of 2
    miss = cache.match(prompt)
    assert (len(miss.hashes), miss.blocks) == (2, [])
    cache.use(miss)
    cache.insert(miss, fake_blocks(2))
    hit = cache.match(prompt)
    assert hit.cached_tokens == 8 and [b.kv[0, 0, 0, 0, 0].item() for b in hit.blocks] == [0, 1]
    cache.use(hit)
    assert cached_blocks(cache, prompt[:4] + [99] * 6) == 1  # the first block is shared
    assert cached_blocks(cache, [99] + prompt[1:]) == 0  # chained: one token changes every key
    stats = cache.stats()
    assert (stats["queries"], stats["hits"], stats["blocks"], stats["inserted"]) == (20, 8, 2, 2)


def test_only_full_blocks_are_cached_and_one_token_is_left_to_compute():
    cache = PrefixCache(block_size=BS)
    assert cache.match(list(range(3))).hashes == []  # shorter than a block: nothing to cache
    fill(cache, list(range(7)))  # one full block, a tail of 3
    assert len(cache) == 1
    fill(cache, list(range(8)))  # exactly two blocks
    assert len(cache) == 2
    # fully cached, but the last block is recomputed: its last token's logits are needed
    assert cached_blocks(cache, list(range(8))) == 1
    assert cached_blocks(cache, list(range(9))) == 2


def test_least_recently_used_blocks_are_evicted_first():
    cache = PrefixCache(block_size=BS, max_blocks=3)
    a, b, c, d = ([k] * 8 for k in (1, 2, 3, 4))  # two blocks each
    fill(cache, a)
    fill(cache, b[:4])  # one block: the cache is full (a1, a2, b1)
    cache.use(cache.match(a + [0]))  # a is used again: b1 is now the oldest
    fill(cache, c[:4])
    assert (cached_blocks(cache, b[:4] + [0]), cached_blocks(cache, a + [0])) == (0, 2)
    fill(cache, d[:4])  # evicts a's deeper block before its first (a hit refreshes deepest first)
    assert (cached_blocks(cache, a + [0]), cached_blocks(cache, c[:4] + [0])) == (1, 1)
    assert cache.stats()["evicted"] == 2 and len(cache) == 3


def test_adapters_never_share_blocks_and_a_reload_never_hits_old_kv():
    cache = PrefixCache(block_size=BS)
    prompt = list(range(9))
    fill(cache, prompt, "policy-v3", adapter_id=3)
    assert cached_blocks(cache, prompt, "policy-v3", 3) == 2
    assert cached_blocks(cache, prompt, "", 0) == 0  # the base model
    assert cached_blocks(cache, prompt, "policy-v4", 4) == 0  # another adapter
    assert cached_blocks(cache, prompt, "policy-v3", 5) == 0  # the name loaded again
    fill(cache, prompt, "", 0)
    assert cache.drop("policy-v3") == 2
    assert (cached_blocks(cache, prompt, "policy-v3", 3), cached_blocks(cache, prompt)) == (0, 2)


def test_reset_flushes_every_block_and_keeps_the_counters():
    cache = PrefixCache(block_size=BS)
    cache.use(fill(cache, list(range(9))))
    fill(cache, list(range(9)), "a", 1)
    assert cache.reset() == 4 and len(cache) == 0
    assert cached_blocks(cache, list(range(9))) == 0
    assert cache.stats()["queries"] == 9 and cache.stats()["resets"] == 1


# ------------------------------------------------------------------ the engine, on and off


def greedy(prompts: list[list[int]], adapter=None, max_tokens: int = 8) -> list[Sequence]:
    return [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                             ignore_eos=True), adapter, make_generator(i))
            for i, p in enumerate(prompts)]


def engine_for(model, tokenizer, cache: PrefixCache | None, **kwargs) -> Engine:
    return Engine(model, eos_token_ids=[tokenizer.eos_token_id], max_model_len=64,
                  prefix_cache=cache, **kwargs).start()


def shared_prefix_prompts(tokenizer) -> tuple[list[int], list[list[int]]]:
    """A 33-token prefix (two full blocks of 16 and one token), then short different tails."""
    prefix = tokenizer("12+34=46,56+78=134,9+9=18,77+1=78,")["input_ids"][:33]
    assert len(prefix) == 33
    tails = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in
             ("5+6=", "31+4=", "8+80=", "5+6=")]  # the last repeats the first: a wave
    other = tokenizer("40+2=42,3+3=6,50+50=100,21+21=42,1+2=")["input_ids"][:36]
    return prefix, [prefix + tails[0], other, prefix + tails[1], prefix + tails[2],
                    prefix + tails[3], tokenizer("7+5=")["input_ids"]]


def run(engine: Engine, seqs: list[Sequence]) -> list[Sequence]:
    try:
        return generate_sync(engine, seqs)
    finally:
        engine.stop()


def assert_same(cached: list[Sequence], plain: list[Sequence]) -> None:
    for a, b in zip(cached, plain, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_greedy_outputs_are_identical_with_and_without_the_cache(tiny_model_and_tokenizer,
                                                                  model_copy):
    model, tokenizer = tiny_model_and_tokenizer
    prefix, prompts = shared_prefix_prompts(tokenizer)
    cache = PrefixCache(block_size=16)
    engine = engine_for(model_copy, tokenizer, cache)
    try:
        warm = generate_sync(engine, greedy([prefix + [5]]))  # caches the prefix's two blocks
        mixed = generate_sync(engine, greedy(prompts))  # cached, uncached, a repeat, a short one
    finally:
        engine.stop()
    plain = run(engine_for(model_copy, tokenizer, None), greedy([prefix + [5]] + prompts))
    assert_same(warm + mixed, plain)
    assert [s.num_cached_tokens for s in mixed] == [32, 0, 32, 32, 32, 0]
    stats = engine.stats
    assert stats["cached_prompt_tokens"] == 4 * 32
    assert stats["prompt_tokens"] == sum(len(p) for p in [prefix + [5]] + prompts)
    assert cache.stats()["hits"] == 4 * 32  # vLLM's counters: in tokens


def test_copies_of_a_prompt_admitted_together_prefill_it_once(tiny_model_and_tokenizer,
                                                              model_copy):
    """n = 4 of an uncached prompt: the first computes it, the others wait one wave and read it."""
    model, tokenizer = tiny_model_and_tokenizer
    prefix, _ = shared_prefix_prompts(tokenizer)
    cache = PrefixCache(block_size=16)
    engine = engine_for(model_copy, tokenizer, cache)
    with_cache = run(engine, greedy([prefix + [7]] * 4))
    assert [s.num_cached_tokens for s in with_cache] == [0, 32, 32, 32]
    assert engine.stats["prefills"] == 2  # two waves, one admission
    plain = run(engine_for(model_copy, tokenizer, None), greedy([prefix + [7]] * 4))
    assert_same(with_cache, plain)


def test_kv_under_an_adapter_is_cached_for_that_adapter_only(tiny_model_and_tokenizer,
                                                             model_copy, make_adapter, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    registry = LoRARegistry(model_copy, max_loras=2, max_lora_rank=8)
    adapters = []
    for i in range(2):
        adapter = read_adapter(f"a{i}", str(make_adapter(tmp_path / f"a{i}", seed=i)),
                               module_shapes=registry.module_shapes, max_lora_rank=8,
                               dtype=torch.float32)
        registry.add(adapter)
        adapters.append(adapter)
    prefix, prompts = shared_prefix_prompts(tokenizer)
    cache = PrefixCache(block_size=16)
    engine = engine_for(model_copy, tokenizer, cache, lora=registry)
    try:
        first = generate_sync(engine, greedy([prefix + [5]], adapters[0]))
        again = generate_sync(engine, greedy([prompts[0], prompts[2]], adapters[0]))
        other = generate_sync(engine, greedy([prompts[0]], adapters[1]) + greedy([prompts[0]]))
    finally:
        engine.stop()
    assert [s.num_cached_tokens for s in first + again + other] == [0, 32, 32, 0, 0]
    plain = engine_for(model_copy, tokenizer, None, lora=registry)
    try:
        reference = generate_sync(plain, greedy([prefix + [5]], adapters[0])
                                  + greedy([prompts[0], prompts[2]], adapters[0])
                                  + greedy([prompts[0]], adapters[1]) + greedy([prompts[0]]))
    finally:
        plain.stop()
    assert_same(first + again + other, reference)


# ------------------------------------------------------------------ grpo-lab serve


def serve_in_process(monkeypatch, tiny_model_and_tokenizer, check, **config):
    from aiohttp.test_utils import TestClient, TestServer

    from grpo_lab.serve.server import InferenceServer

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    model, tokenizer = tiny_model_and_tokenizer
    server = InferenceServer(ServeConfig(**config), model=copy.deepcopy(model), tokenizer=tokenizer)

    async def main():
        async with TestClient(TestServer(server.build_app(), host="127.0.0.1")) as client:
            await check(client, server)

    asyncio.run(main())


def metric(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_metrics_reset_and_adapter_reloads_through_the_server(monkeypatch, make_adapter,
                                                              tiny_model_and_tokenizer, tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    prefix, _ = shared_prefix_prompts(tokenizer)
    make_adapter(tmp_path / "a", seed=1)
    make_adapter(tmp_path / "b", seed=2)

    async def complete(http, model="", n=2):
        reply = await http.post("/v1/completions", json={
            "model": model, "prompt": prefix + [5], "max_tokens": 2, "n": n, "seed": 0,
            "ignore_eos": True})  # seeded sampling: n > 1 at temperature 0 is a 400, as in vLLM
        assert reply.status == 200

    async def check(http, server):
        cache = server.engine.prefix_cache
        await complete(http)  # n = 2: the second copy reads the first's two blocks
        text = await (await http.get("/metrics")).text()
        assert metric(text, "vllm:prefix_cache_queries_total") == 2 * 34
        assert metric(text, "vllm:prefix_cache_hits_total") == 32
        assert metric(text, "vllm:prompt_tokens_total") == 2 * 34
        assert metric(text, "vllm:prompt_tokens_cached_total") == 32
        assert metric(text, "vllm:generation_tokens_total") == 4
        assert "# TYPE vllm:prefix_cache_hits_total counter" in text
        info = (await (await http.get("/server_info?config_format=json")).json())["vllm_config"]
        assert info["cache_config"] == {"block_size": 16, "enable_prefix_caching": True}
        assert info["grpo_lab"]["prefix_cache"]["hits"] == 32
        reply = await http.post("/reset_prefix_cache")
        assert (reply.status, await reply.text()) == (200, "")
        assert len(cache) == 0
        for name in ("a", "b"):
            await http.post("/v1/load_lora_adapter",
                            json={"lora_name": name, "lora_path": str(tmp_path / name)})
            await complete(http, name, n=1)
        assert len(cache) == 4  # two blocks under each adapter
        await http.post("/v1/load_lora_adapter", json={  # a new version under the name "a"
            "lora_name": "a", "lora_path": str(tmp_path / "b"), "load_inplace": True})
        assert len(cache) == 2
        await http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert len(cache) == 0

    serve_in_process(monkeypatch, tiny_model_and_tokenizer, check, enable_lora=True,
                     max_lora_rank=8, max_loras=2)


def test_prefix_caching_flags_and_the_server_without_a_cache(monkeypatch,
                                                             tiny_model_and_tokenizer):
    from grpo_lab.cli.flags import config_from_args
    from grpo_lab.cli.main import build_parser

    def parsed(*flags) -> ServeConfig:
        return config_from_args(build_parser().parse_args(["serve", "m", *flags]), ServeConfig)

    assert parsed().enable_prefix_caching and parsed().block_size == 16
    assert parsed("--enable-prefix-caching").enable_prefix_caching
    assert not parsed("--enable-prefix-caching", "false").enable_prefix_caching
    assert not parsed("--no-enable-prefix-caching").enable_prefix_caching
    assert parsed("--block-size", "8", "--prefix-cache-max-blocks", "10").block_size == 8
    with pytest.raises(ValueError, match="block_size"):
        ServeConfig(block_size=0)

    async def check(http, server):
        assert server.engine.prefix_cache is None
        reply = await http.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
        assert reply.status == 200
        text = await (await http.get("/metrics")).text()
        assert metric(text, "vllm:prefix_cache_queries_total") == 0
        assert metric(text, "vllm:prompt_tokens_total") == 2
        assert (await http.post("/reset_prefix_cache")).status == 200

    serve_in_process(monkeypatch, tiny_model_and_tokenizer, check, enable_prefix_caching=False)
