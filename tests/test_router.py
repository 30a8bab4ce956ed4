"""The KV-prefix router (grpo_lab.proxy.router) and its workload replay (routing_replay)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab.proxy import router as router_module
from grpo_lab.proxy.router import NoReplicaAvailable, PrefixRouter, RouterConfig
from grpo_lab_course.routing_replay import replay

ROOT = Path(__file__).resolve().parents[1]
BS = 16  # the default block size

# A shared 16-token chat template (exactly one block) and two prompts that start with it.
TEMPLATE = list(range(1000, 1000 + BS))
P1 = TEMPLATE + list(range(2000, 2000 + 2 * BS))  # 3 blocks: template + 2 of its own
P2 = TEMPLATE + list(range(3000, 3000 + 2 * BS))  # same first block, then different


def tokens(start: int, n_blocks: int) -> list[int]:
    """A prompt of `n_blocks` full blocks sharing nothing with prompts from other starts."""
    return list(range(start, start + n_blocks * BS))


def test_four_request_walkthrough():
    router = PrefixRouter(["r0", "r1"])
    # A1: nothing is known, both replicas are idle -> unmatched, round robin starts at r0
    a1 = router.route(P1, "policy-v0")
    assert (a1.replica, a1.kind, a1.specific_match_blocks, a1.prompt_blocks) == (
        "r0", "unmatched", 0, 3)  # fmt: skip
    # A2: the same prompt -> r0 holds all 3 blocks, none common -> affinity, although r0 is busier
    a2 = router.route(P1, "policy-v0")
    assert (a2.replica, a2.kind, a2.specific_match_blocks, a2.common_prefix_blocks) == (
        "r0", "affinity", 3, 0)  # fmt: skip
    # B1: shares only the template block. It now has two successors -> common, so r0's one-block
    # match is not specific -> unmatched, least loaded (r1: 0 in flight against 2)
    b1 = router.route(P2, "policy-v0")
    assert (b1.replica, b1.kind, b1.specific_match_blocks, b1.common_prefix_blocks) == (
        "r1", "unmatched", 0, 1)  # fmt: skip
    # B2: P2 again -> r1 holds its 2 specific blocks
    b2 = router.route(P2, "policy-v0")
    assert (b2.replica, b2.kind, b2.specific_match_blocks, b2.common_prefix_blocks) == (
        "r1", "affinity", 2, 1)  # fmt: skip
    # and P1 still lives on r0, now with the template counted as common
    a3 = router.route(P1, "policy-v0")
    assert (a3.replica, a3.kind, a3.specific_match_blocks) == ("r0", "affinity", 2)
    s = router.stats()
    assert s["routed"] == [3, 2] and s["inflight"] == [3, 2]
    assert (s["affinity"], s["spilled"], s["unmatched"]) == (3, 0, 2)


def test_shared_template_block_gives_no_affinity_even_to_the_idle_owner():
    router = PrefixRouter(["r0", "r1"])
    assert router.route(P1, "v").replica == "r0"
    router.finish("r0")  # both idle again; round robin now points at r1
    d = router.route(P2, "v")  # r0 matches the template block, which is common -> no affinity
    assert (d.kind, d.replica, d.common_prefix_blocks) == ("unmatched", "r1", 1)


def test_prefix_extension_keeps_affinity():
    # a prompt that extends a cached one (one successor so far) is still specific to its replica
    router = PrefixRouter(["r0", "r1"])
    router.route(P1, "v")
    router.finish("r0")
    longer = router.route(P1 + tokens(9000, 2), "v")
    assert (longer.replica, longer.kind, longer.specific_match_blocks) == ("r0", "affinity", 3)


def test_prompt_cached_on_every_replica_goes_to_least_loaded():
    router = PrefixRouter(["r0", "r1"], RouterConfig(imbalance=0))
    assert router.route(P1, "v").kind == "unmatched"  # r0, loads (1, 0)
    spill = router.route(P1, "v")  # r0 is 1 ahead, imbalance 0 -> spill to r1
    assert (spill.replica, spill.kind) == ("r1", "spill")
    router.route(tokens(5000, 2), "v")  # unrelated: round robin -> r0, loads (2, 1)
    # every block of P1 is now on both replicas: common, so no replica has a specific match...
    d = router.route(P1, "v")
    assert (d.specific_match_blocks, d.common_prefix_blocks) == (0, 3)
    # ...the least-loaded replica takes it, and it is a cache hit there, not a cold request
    assert (d.replica, d.kind, d.cached_everywhere) == ("r1", "affinity", True)
    s = router.stats()
    assert (s["unmatched"], s["cached_everywhere"]) == (2, 1)
    assert s["unmatched_reference_pct"] == 75.0  # the reference proxy would say 3 of 4 unmatched


def test_new_adapter_version_shares_no_blocks():
    router = PrefixRouter(["r0", "r1"])
    h0, h1 = router.block_hashes(P1, "policy-v3"), router.block_hashes(P1, "policy-v4")
    assert len(h0) == len(h1) == 3 and not set(h0) & set(h1)
    router.route(P1, "policy-v3")  # r0
    router.finish("r0")
    again = router.route(P1, "policy-v3")
    assert (again.replica, again.kind) == ("r0", "affinity")
    router.finish("r0")
    d = router.route(P1, "policy-v4")  # same tokens, new policy: r0's cache does not apply
    assert (d.kind, d.replica) == ("unmatched", "r1")


def test_hashes_are_chained_and_ignore_the_partial_block():
    router = PrefixRouter(2)
    x = tokens(100, 2) + [7] * 5
    assert router.block_hashes(x, "a") == router.block_hashes(x[: 2 * BS], "a")
    # block 2 is the same, block 1 differs -> h2 differs too: h2 names the whole prefix
    y = tokens(500, 1) + x[BS : 2 * BS]
    assert router.block_hashes(x, "a")[1] != router.block_hashes(y, "a")[1]
    assert router.block_hashes(x[: BS - 1], "a") == []


def test_prompt_shorter_than_a_block_is_always_unmatched():
    router = PrefixRouter(["r0", "r1"])
    short = list(range(15))
    kinds = [router.route(short, "v").kind for _ in range(4)]
    assert kinds == ["unmatched"] * 4
    assert router.stats()["routed"] == [2, 2] and router.stats()["tracked_blocks"] == 0


def test_imbalance_spills_to_least_loaded():
    router = PrefixRouter(["r0", "r1"], RouterConfig(imbalance=2))
    got = [router.route(P1, "v") for _ in range(4)]  # nothing finishes: r0 keeps getting busier
    assert [(d.replica, d.kind) for d in got] == [
        ("r0", "unmatched"), ("r0", "affinity"), ("r0", "affinity"), ("r1", "spill")]  # fmt: skip
    assert got[3].specific_match_blocks == 3  # what the spill gave up
    s = router.stats()
    assert (s["spilled"], s["spill_pct"], s["inflight"]) == (1, 25.0, [3, 1])


def test_default_guard_keeps_groups_together_in_the_replay():
    # the guard's default (about 1.5 G for G = 8) lets ordinary groups stay on their replica: few
    # spills, so few prompts end up on both replicas (the reference's labels count those unmatched)
    r = replay(2, prompts_issued=800, seed=0)
    assert RouterConfig().imbalance == 12
    assert r["spill_pct"] <= 0.5
    assert r["unmatched_reference_pct"] <= r["unmatched_floor_pct"] + 0.3
    eight = replay(2, prompts_issued=800, seed=0, router=RouterConfig(imbalance=8))
    assert eight["spill_pct"] > 0.5  # the reference proxy's 8 = G spills the tails of groups
    assert sum(eight["by_rollout_index"]["spill"][:5]) == 0


def test_remembered_prompt_hashes_change_no_decision(monkeypatch):
    # route() keeps the hashes of recent (adapter, prompt) pairs; a router that remembers none
    # must decide exactly the same
    rng = random.Random(0)
    prompts = [TEMPLATE + tokens(rng.randrange(10**6), rng.randrange(4)) for _ in range(6)]
    routers = {n: PrefixRouter(2, RouterConfig(imbalance=1)) for n in (0, 3 * 4 * BS)}
    for step in range(300):
        prompt, adapter = rng.choice(prompts), rng.choice(["v1", "v2"])
        finish = rng.random() < 0.4
        decisions = []
        for n, router in routers.items():
            monkeypatch.setattr(router_module, "RECENT_PROMPT_TOKENS", n)
            decisions.append(router.route(prompt, adapter))
            if finish:
                router.finish(decisions[-1].replica)
        assert decisions[0] == decisions[1], step
    assert routers[0].stats() == routers[3 * 4 * BS].stats()
    assert not routers[0]._recent and 0 < routers[3 * 4 * BS]._recent_tokens <= 3 * 4 * BS


def test_round_robin_on_ties():
    router = PrefixRouter(["a", "b", "c"])
    picks = []
    for i in range(5):
        d = router.route(tokens(10_000 * (i + 1), 2), "v")  # unrelated prompts
        picks.append(d.replica)
        router.finish(d.replica)  # all idle again before the next one
    assert picks == ["a", "b", "c", "a", "b"]
    # unequal loads: the least loaded wins regardless of the pointer
    router.route(tokens(90_000, 1), "v")  # -> c
    router.route(tokens(91_000, 1), "v")  # -> a
    assert router.route(tokens(92_000, 1), "v").replica == "b"
    assert router.route(tokens(93_000, 1), "v").replica == "c"  # all at 1: pointer after b


def test_lru_cap_evicts_least_recently_used_blocks():
    router = PrefixRouter(["r0", "r1"], RouterConfig(max_tracked_blocks=6))
    p, q, r = tokens(1, 3), tokens(50_000, 3), tokens(90_000, 3)
    for prompt in (p, q, p, r):  # p is touched again after q, so q is the oldest when r arrives
        router.finish(router.route(prompt, "v").replica)
    assert (router.stats()["tracked_blocks"], router.stats()["evicted"]) == (6, 3)
    assert router.route(p, "v").kind == "affinity"
    assert router.route(q, "v").kind == "unmatched"  # forgotten


def test_mark_down_and_up():
    router = PrefixRouter(["r0", "r1"])
    router.route(P1, "v")  # r0
    router.mark_down("r0")
    d = router.route(P1, "v")  # r0 has the prefix but is down; it also lost its cache
    assert (d.replica, d.kind) == ("r1", "unmatched")
    router.mark_down(1)
    with pytest.raises(NoReplicaAvailable):
        router.route(P1, "v")
    router.mark_up("r0")
    assert router.route(P2, "v").replica == "r0"
    assert router.stats()["up"] == [True, False]
    with pytest.raises(KeyError):
        router.mark_down("r9")


def test_mark_down_without_forgetting_keeps_ownership():
    router = PrefixRouter(["r0", "r1"])
    router.finish(router.route(P1, "v").replica)  # r0
    router.mark_down("r0", forget=False)  # a drain, not a crash
    router.mark_up("r0")
    assert router.route(P1, "v").replica == "r0"


def test_round_robin_takes_turns_and_counts_what_affinity_would_have_done():
    router = PrefixRouter(["r0", "r1"], RouterConfig(routing="round-robin"))
    got = [router.route(P1, "v") for _ in range(4)]  # nothing finishes
    assert [d.replica for d in got] == ["r0", "r1", "r0", "r1"]  # the cache is ignored
    # 1: cold. 2: r0 holds P1, the turn is r1's -> spill. 3, 4: both hold it -> cached everywhere
    assert [d.kind for d in got] == ["unmatched", "spill", "affinity", "affinity"]
    router.finish("r0")
    d = router.route(P2, "v")  # r0 is now less loaded, but the turn is r0's anyway
    assert (d.replica, d.kind) == ("r0", "unmatched")
    s = router.stats()
    assert (s["affinity"], s["spilled"], s["unmatched"], s["cached_everywhere"]) == (2, 1, 2, 2)
    assert s["routed"] == [3, 2]
    router.mark_down("r1")
    assert router.route(P2, "v").replica == "r0"  # a down replica loses its turn
    with pytest.raises(ValueError, match="routing"):
        RouterConfig(routing="random")


def test_finish_without_inflight_and_bad_config_raise():
    router = PrefixRouter(2)
    with pytest.raises(ValueError):
        router.finish("replica-0")
    with pytest.raises(ValueError):
        RouterConfig(block_size=0)
    with pytest.raises(ValueError):
        PrefixRouter(["x", "x"])


@settings(max_examples=40, deadline=None)
@given(
    n_replicas=st.integers(1, 4),
    imbalance=st.integers(0, 3),
    routing=st.sampled_from(["affinity", "round-robin"]),
    ops=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=60),
    seed=st.integers(0, 1000),
)
def test_counters_add_up_and_down_replicas_are_never_picked(n_replicas, imbalance, routing, ops,
                                                            seed):
    router = PrefixRouter(n_replicas, RouterConfig(imbalance=imbalance, max_tracked_blocks=20,
                                                   routing=routing))
    pool = [TEMPLATE + tokens(10_000 * (i + 1), i % 3) + [i] * (i % 5) for i in range(6)]
    rng = random.Random(seed)
    down = 0 if n_replicas > 1 else None  # replica 0 is down for the second half
    inflight: list[str] = []
    finished = 0
    for step, (which, finish) in enumerate(ops):
        if down is not None and step == len(ops) // 2:
            router.mark_down(down)
        d = router.route(pool[which], f"v{step // 20}")
        if down is not None and step >= len(ops) // 2:
            assert d.replica != router.replicas[down]
        inflight.append(d.replica)
        if finish:
            router.finish(inflight.pop(rng.randrange(len(inflight))))
            finished += 1
    s = router.stats()
    assert s["affinity"] + s["spilled"] + s["unmatched"] == s["requests"] == len(ops)
    assert sum(s["routed"]) == len(ops) and sum(s["inflight"]) == len(ops) - finished
    assert s["cached_everywhere"] <= s["affinity"] and s["tracked_blocks"] <= 20
    assert abs(s["affinity_pct"] + s["spill_pct"] + s["unmatched_pct"] - 100) < 0.05


# ---- the replay -------------------------------------------------------------------------------


def test_small_replay_respects_the_floor_and_counts_every_rollout():
    # 200 prompts from 1,460 problems: each prompt is new, so its first rollout must be cold
    r = replay(2, prompts_issued=200, seed=1)
    assert r["rollouts"] == 200 * 8 == sum(r["routed"])
    assert r["affinity"] + r["spilled"] + r["unmatched"] == r["rollouts"]
    assert r["inflight"] == [0, 0]
    assert r["unmatched_pct"] >= r["unmatched_floor_pct"] == 12.5
    assert r["by_rollout_index"]["unmatched"][0] == 200  # every group's first rollout is cold
    assert r["affinity_pct"] > 80  # and most of the other seven find it


def test_replay_floor_is_about_cold_prompts():
    # 16 problems seen 4 times under one adapter name: later epochs start warm, below 1/G
    r = replay(3, num_problems=16, prompts_issued=64, sync_every_steps=10**6, seed=0)
    assert r["syncs"] == 0 and r["unmatched_pct"] < r["unmatched_floor_pct"]


def test_benchmark_script_quick(tmp_path):
    out = tmp_path / "routing_replay.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "routing_replay.py"), "--quick", "--out", out],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1 = a goal missed, still a valid run
    result = json.loads(out.read_text())
    assert [run["num_replicas"] for run in result["runs"]] == [2, 3]
    assert all(run["rollouts"] == 800 * 8 == sum(run["routed"]) for run in result["runs"])
    assert "affinity" in proc.stdout and "unmatched" in proc.stdout


def test_a_template_longer_than_one_block_is_common_up_to_its_branch_point():
    """Prompts sharing a 2-block template then differing: the template gives no affinity."""
    router = PrefixRouter(2)
    template = list(range(100, 132))  # two full blocks
    a = template + list(range(16))
    b = template + list(range(50, 66))
    c = template + list(range(200, 216))
    router.route(a, "v1")
    router.route(b, "v1")  # block 2 now has two successors: blocks 1-2 are the template
    decision = router.route(c, "v1")
    assert decision.kind == "unmatched" and decision.common_prefix_blocks == 2
