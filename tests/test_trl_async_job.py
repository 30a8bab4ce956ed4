"""`grpo-lab train-trl-async`: TRL's AsyncGRPOTrainer as the trainer job (grpo_lab.rollout.trl_async).

Fast: the CPU tree attention (grpo_lab.rollout.trl_cpu) against plain causal attention on rows
packed by TRL's own `TreeRow`; the rewards and settings handed to TRL.
Slow: TRL's trainer trains the chat model for 3 steps through `grpo-lab proxy` in front of two
`grpo-lab serve` replicas. The job process gets tests/trl_stand_ins/ on its PYTHONPATH: stand-ins
for the vLLM modules TRL imports (see its README); nothing else in the test session sees them.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from grpo_lab.core.chat_model import SYSTEM_PROMPT
from grpo_lab.rollout.config import AsyncGRPOConfig
from grpo_lab.rollout.trl_async import (
    LORA_NAME,
    TrlAsyncJobConfig,
    reward_funcs,
    trl_config,
    with_response_parser,
)
from grpo_lab.rollout.trl_cpu import tree_attention_cpu

STAND_INS = Path(__file__).parent / "trl_stand_ins"
ROOT = Path(__file__).resolve().parent.parent


def causal_attention(q, k, v):
    """(H, T, D) plain causal attention, K/V heads repeated for grouped queries."""
    repeat = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_cpu_tree_attention_equals_causal_attention_per_sample():
    """Three samples sharing a prompt, packed by TRL's TreeRow: every token's output equals what
    plain causal attention over its own sample gives it (4 query heads, 2 KV heads)."""
    import numpy as np
    from trl.experimental.async_grpo.packing import TreeRow

    samples = [[5, 6, 7, 8, 1, 2], [5, 6, 7, 8, 3], [5, 6, 9, 4, 4, 4]]
    row = TreeRow()
    for ids in samples:
        row.add({"input_ids": np.array(ids), "completion_mask": np.ones(len(ids), dtype=int),
                 "old_log_probs": np.zeros(len(ids)), "advantage": 0.0, "group_id": 0})
    packed = row.pack()
    n = len(packed["input_ids"])
    assert n < sum(map(len, samples))  # the shared prefix is forwarded once
    gen = torch.Generator().manual_seed(0)
    # one query/key/value vector per vocabulary id and position: a token's vectors depend on
    # what it is and where it stands, as after a rotary embedding
    table = {name: torch.randn(10, 8, heads, 4, generator=gen)
             for name, heads in (("q", 4), ("k", 2), ("v", 2))}

    def vectors(name, ids, positions):  # -> (1, H, T, D)
        return torch.stack([table[name][i, p] for i, p in zip(ids, positions)], 1)[None]

    ids, pos = packed["input_ids"].tolist(), packed["position_ids"].tolist()
    out, _ = tree_attention_cpu(
        None, vectors("q", ids, pos), vectors("k", ids, pos), vectors("v", ids, pos), None,
        tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"])
    assert out.shape == (1, n, 4, 4)
    cu_q, cu_k = packed["tree_cu_seqlens_q"].tolist(), packed["tree_cu_seqlens_k"].tolist()
    kv = packed["tree_kv_index"].tolist()
    assert len(cu_q) > 2  # the samples branch: several segments
    for seg in range(len(cu_q) - 1):
        path = kv[cu_k[seg]:cu_k[seg + 1]]  # packed positions, root to the segment's end
        tokens = [ids[i] for i in path]
        assert any(sample[:len(tokens)] == tokens for sample in samples)  # a sample's prefix
        want = causal_attention(*(vectors(x, tokens, range(len(tokens)))[0] for x in "qkv"))
        got = out[0, cu_q[seg]:cu_q[seg + 1]].transpose(0, 1)  # the segment's own tokens
        torch.testing.assert_close(got, want[:, len(tokens) - got.shape[1]:])


def test_rewards_are_weighted_picklable_and_named():
    config = AsyncGRPOConfig(reward="math_answer,format", reward_weights="1.0,0.5",
                             output_dir="x")
    funcs = pickle.loads(pickle.dumps(reward_funcs(config)))  # TRL scores in a spawned process
    assert [f.__name__ for f in funcs] == ["math_answer", "format"]
    done = [[{"role": "assistant", "content": "2 + 8 = 10\n#### 10"}]]
    assert funcs[0](done, answer=["#### 10"]) == [1.0]
    assert funcs[1](done, answer=["#### 10"]) == [0.5 * reward_funcs(
        AsyncGRPOConfig(reward="format"))[0](done, answer=["#### 10"])[0]]


def test_trl_config_maps_grpo_lab_settings(tmp_path):
    config = AsyncGRPOConfig(steps=7, prompts_per_step=3, num_generations=4, learning_rate=5e-4,
                             max_staleness=2, weight_sync_steps=2, buffer_size=5,
                             epsilon_low=0.1, epsilon_high=0.3)
    job = TrlAsyncJobConfig(server_url="http://127.0.0.1:9", max_inflight=6)
    args = trl_config(config, job, tmp_path, "cpu", 12)
    assert (args.max_steps, args.per_device_train_batch_size, args.num_generations) == (7, 12, 4)
    assert (args.max_staleness, args.weight_sync_steps, args.queue_maxsize) == (2, 2, 20)
    assert (args.epsilon, args.epsilon_high, args.learning_rate) == (0.1, 0.3, 5e-4)
    assert (args.max_completion_length, args.max_inflight_tasks) == (12, 6)
    assert args.vllm_server_base_url == "http://127.0.0.1:9" and args.use_cpu
    assert args.dtype == "float32" and not args.bf16
    with pytest.raises(ValueError, match="server-url"):
        TrlAsyncJobConfig()


@pytest.mark.parametrize("command", ["train-trl-async", "train-async"])
def test_help_lists_the_flags(command, capsys):
    from grpo_lab.cli.main import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([command, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "--server-url" in text and "--max-staleness" in text and "--reward" in text


def test_without_vllm_the_job_says_what_to_do(tmp_path):
    from grpo_lab.rollout.trl_async import run_train_trl_async

    assert "vllm" not in sys.modules  # the stand-ins are on the job's path only
    with pytest.raises(ValueError, match="vLLM image"):
        run_train_trl_async(AsyncGRPOConfig(output_dir=str(tmp_path)),
                            TrlAsyncJobConfig(server_url="http://127.0.0.1:9"))


def test_response_parser_chatml_only(chat_model_dir, tiny_model_dir):
    from transformers import AutoTokenizer

    chat = with_response_parser(AutoTokenizer.from_pretrained(chat_model_dir))
    assert chat.response_template["start_anchor"] == "<|im_start|>assistant\n"
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="response_template"):
        with_response_parser(plain)


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


@pytest.mark.slow
def test_trl_async_trainer_trains_through_the_proxy_and_two_replicas(chat_model_dir, tmp_path):
    """3 optimizer steps of TRL's AsyncGRPOTrainer: every completion through the proxy, each
    weight sync a versioned adapter loaded on both replicas from the bucket."""
    from grpo_lab.proxy.process import start_proxy_process
    from grpo_lab.serving.process import start_server_process

    out, bucket = tmp_path / "run", tmp_path / "bucket"
    serve = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 4}  # >= max_staleness + 2
    with start_server_process(str(chat_model_dir), **serve) as a, \
            start_server_process(str(chat_model_dir), **serve) as b, \
            start_proxy_process([a.url, b.url]) as proxy:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(STAND_INS)]),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "grpo_lab.cli", "train-trl-async",
                   "--server-url", proxy.url, "--output-dir", str(out), "--bucket", str(bucket),
                   "--model", str(chat_model_dir), "--dataset", str(chat_model_dir / "data"),
                   "--reward", "math_answer", "--system-prompt", SYSTEM_PROMPT,
                   "--steps", "3", "--prompts-per-step", "2", "--num-generations", "4",
                   "--max-new-tokens", "24", "--lora-rank", "2", "--learning-rate", "1e-3",
                   "--max-staleness", "1"]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        held = [{m["id"]: m["root"] for m in _get(r.url + "/v1/models")["data"] if m["parent"]}
                for r in (a, b)]
        stats = _get(proxy.url + "/proxy/stats")

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["trainer"] == "trl"
    # one version at train begin, then one per step (weight_sync_steps = 1)
    assert summary["version"] == 4
    assert [f"[step {s}/3]" in run.stdout for s in (1, 2, 3)] == [True] * 3
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in records)
    assert (out / "adapter" / "adapter_config.json").exists()
    # both replicas hold the newest versions, loaded from the bucket; older ones were unloaded
    newest = {f"{LORA_NAME}-v3", f"{LORA_NAME}-v4"}
    for adapters in held:
        assert set(adapters) == newest
        assert all(Path(root).parent == bucket.resolve() for root in adapters.values())
    assert {f"{LORA_NAME}-v4", f"{LORA_NAME}-v3"} <= set(summary["adapters_in_bucket"])
    # the completions came from the replicas, through the proxy, on both of them
    assert stats["completion_calls"] >= 3 * 2 * 4
    assert all(n > 0 for n in stats["routed"]) and sum(stats["errors"].values()) == 0
    assert stats["broadcasts"]["load_lora_adapter"] == 4
    assert stats["broadcasts"]["pause"] == stats["broadcasts"]["resume"] == 4
    assert stats["broadcasts"]["unload_lora_adapter"] == 2
