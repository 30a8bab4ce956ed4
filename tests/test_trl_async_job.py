"""`grpo-lab train-trl-async`: TRL's AsyncGRPOTrainer as the trainer job (trl/async_trainer).

Fast: the CPU tree attention (grpo_lab.trl.cpu) against plain causal attention on rows
packed by TRL's own `TreeRow`; the rewards and settings handed to TRL.
Slow: TRL's trainer trains the chat model for 3 steps through `grpo-lab proxy` in front of two
`grpo-lab serve` replicas; a run checkpoints and a restarted one resumes from its step. The job
imports the real `vllm` package where it is installed; only where it is not does the job process
get tests/trl_stand_ins/ on its PYTHONPATH: stand-ins for the vLLM modules TRL imports (see its
README); nothing else in the test session sees them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import queue
import shutil
import subprocess
import sys
import urllib.request
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from real_vllm import require_vllm

from grpo_lab.model.chat_model import SYSTEM_PROMPT
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.trl import cpu as trl_cpu
from grpo_lab.trl.async_job import TrlAsyncJobConfig, run_train_trl_async
from grpo_lab.trl.async_trainer import (
    LORA_NAME,
    micro_batch_size,
    reward_funcs,
    trl_async_grpo,
    trl_config,
    with_response_parser,
)
from grpo_lab.trl.cpu import tree_attention_cpu, trl_internal

STAND_INS = Path(__file__).parent / "trl_stand_ins"
ROOT = Path(__file__).resolve().parent.parent
REAL_VLLM = importlib.util.find_spec("vllm") is not None
"""The real package is installed: the job imports it, and the stand-ins stay off its path."""


def causal_attention(q, k, v):
    """(H, T, D) plain causal attention, K/V heads repeated for grouped queries."""
    repeat = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(repeat, 0), v.repeat_interleave(repeat, 0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_cpu_tree_attention_equals_causal_attention_per_sample():
    """Three samples sharing a prompt, packed by TRL's TreeRow: every token's output equals what
    plain causal attention over its own sample gives it (4 query heads, 2 KV heads)."""
    import numpy as np

    TreeRow = trl_internal("packing").TreeRow  # TRL's own packing (internal: see trl_cpu)
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


def test_trl_outside_the_tested_range_is_refused_with_the_range_and_the_extra(monkeypatch):
    """Every use of TRL (its classes, its internals) checks the installed release against the
    `trl` extra first: one outside it, or none, gets an ImportError naming the range and how to
    install it; the installed one (CI's) passes."""
    assert trl_internal("packing").TREE_ATTENTION  # the installed TRL is a tested one
    assert trl_async_grpo()[1].__name__ == "AsyncGRPOTrainer"
    for found in ("1.17.0", "1.18.0", "1.15.0", "2.0.0"):
        monkeypatch.setattr(trl_cpu, "version", lambda _name, found=found: found)
        for use in (lambda: trl_internal("packing"), trl_async_grpo):
            with pytest.raises(ImportError, match=rf"needs trl <1\.17,>=1\.16\.0.*found "
                               rf"{found}.*pip install 'grpo_lab\[trl\]'"):
                use()

    def missing(_name):
        raise trl_cpu.PackageNotFoundError("trl")

    monkeypatch.setattr(trl_cpu, "version", missing)
    with pytest.raises(ImportError, match="found none installed"):
        trl_async_grpo()



def test_no_other_file_imports_trl_submodules_that_trl_removes():
    """Only trl/cpu.py names TRL's async-GRPO submodules (TRL 1.18 removes them); the
    rest of grpo_lab, the tests, benchmarks and notebooks use TRL's public surface."""
    import re

    removed = re.compile(r"trl\.experimental\.async_grpo\.\w|from trl\.experimental\.async_grpo "
                         r"import [^\n]*\b(packing|async_grpo_trainer)\b")
    files = [p for folder in ("grpo_lab", "tests", "benchmarks", "notebooks")
             for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".ipynb")]
    offenders = [p.relative_to(ROOT).as_posix() for p in files
                 if removed.search(p.read_text())
                 and p.relative_to(ROOT).as_posix() != "grpo_lab/trl/cpu.py"]
    assert offenders == []


def test_rewards_are_weighted_picklable_and_named():
    config = AsyncGRPOConfig(reward="math_answer,format", reward_weights="1.0,0.5",
                             output_dir="x")
    funcs = pickle.loads(pickle.dumps(reward_funcs(config)))  # TRL scores in a spawned process
    assert [f.__name__ for f in funcs] == ["math_answer", "format"]
    done = [[{"role": "assistant", "content": "2 + 8 = 10\n#### 10"}]]
    assert funcs[0](done, answer=["#### 10"]) == [1.0]
    assert funcs[1](done, answer=["#### 10"]) == [0.5 * reward_funcs(
        AsyncGRPOConfig(reward="format"))[0](done, answer=["#### 10"])[0]]


def test_trl_config_maps_grpo_lab_settings(tmp_path, monkeypatch):
    config = AsyncGRPOConfig(steps=7, prompts_per_step=3, num_generations=4, learning_rate=5e-4,
                             max_staleness=2, weight_sync_steps=2, buffer_size=5,
                             epsilon_low=0.1, epsilon_high=0.3)
    job = TrlAsyncJobConfig(server_url="http://127.0.0.1:9", max_inflight=6)
    args = trl_config(config, job, tmp_path, "cpu", 12)
    assert (args.max_steps, args.per_device_train_batch_size, args.num_generations) == (7, 12, 4)
    assert (args.gradient_accumulation_steps, args.token_budget) == (1, 0)  # fixed count
    assert (args.max_staleness, args.weight_sync_steps, args.queue_maxsize) == (2, 2, 20)
    assert (args.epsilon, args.epsilon_high, args.learning_rate) == (0.1, 0.3, 5e-4)
    assert (args.max_completion_length, args.max_inflight_tasks) == (12, 6)
    assert args.vllm_server_base_url == "http://127.0.0.1:9" and args.use_cpu
    assert args.dtype == "float32" and not args.bf16
    # the reference's optimizer: AdamW betas (0.9, 0.95), no weight decay; TRL's 600 s timeout
    assert (args.adam_beta1, args.adam_beta2, args.weight_decay) == (0.9, 0.95, 0.0)
    assert args.request_timeout == 600 == TrlAsyncJobConfig(server_url="x").request_timeout_s
    # checkpoints into the run's folder, the newest two kept
    assert (args.save_strategy, args.save_steps, args.save_total_limit) == ("steps", 10, 2)
    assert trl_config(config, TrlAsyncJobConfig(server_url="x", checkpoint_every=0), tmp_path,
                      "cpu", 12).save_strategy == "no"
    # on a GPU: float32 weights, bfloat16 autocast (this machine has no GPU for the check)
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    gpu = trl_config(config, job, tmp_path, "cuda", 12)
    assert gpu.dtype == "float32" and gpu.bf16 and not gpu.fp16 and not gpu.use_cpu
    with pytest.raises(ValueError, match="server-url"):
        TrlAsyncJobConfig()


def test_micro_batch_size_divides_the_step():
    assert micro_batch_size(8, 32, None) == 8  # no budget: the whole step at once
    assert micro_batch_size(12, 32, 100) == 3  # 3 x 32 tokens <= 100
    assert micro_batch_size(8, 32, 100) == 2  # 3 fit, but 8 samples split only into 2s
    assert micro_batch_size(8, 200, 100) == 1  # one sample even past the budget
    assert micro_batch_size(128, 1096 + 3000, 16384) == 4  # the blog: 32 accumulated


def samples_per_optimizer_step(args, prompt: int, completions: list[int], steps: int = 3):
    """Samples in each of `steps` optimizer steps as TRL's trainer builds them from `args`: its
    own `get_train_dataloader` (batcher and collator) over a queue of rollout samples, each step
    `gradient_accumulation_steps` micro-batches, as transformers' training loop draws them.
    Returns (samples per step, the most tokens a micro-batch forwarded)."""
    import numpy as np

    _, AsyncGRPOTrainer = trl_async_grpo()
    rollouts = queue.Queue()
    group = args.num_generations
    for g in range(4 * steps * args.per_device_train_batch_size
                   * args.gradient_accumulation_steps // group + 1):
        for i in range(group):  # G completions of one prompt, sharing its tokens
            n = completions[(g * group + i) % len(completions)]
            ids = np.array([7] * prompt + [100 + g * group + i] * n)
            rollouts.put(SimpleNamespace(
                input_ids=ids, completion_mask=np.array([0] * prompt + [1] * n),
                old_log_probs=np.zeros(len(ids)), advantage=1.0, group_id=g, metrics={},
                model_version=0, enqueued_at=None))

    def queue_ran_dry(_stale_after_s):
        raise AssertionError("the batcher wanted more samples than the test queued")

    metrics = defaultdict(list)
    trainer = SimpleNamespace(  # what get_train_dataloader reads of the trainer
        accelerator=SimpleNamespace(num_processes=1, is_main_process=True, prepare=lambda d: d),
        args=args, rollout_queue=rollouts, model_version=0, _trained_groups=set(),
        rollout_worker=SimpleNamespace(check_health=queue_ran_dry), _metrics={"train": metrics},
        vllm_client=SimpleNamespace(wait_for_server_ready=lambda: None,
                                    get_max_model_len=lambda: 256),  # grpo-lab serve's
        processing_class=SimpleNamespace(pad_token_id=0))
    microbatches = iter(AsyncGRPOTrainer.get_train_dataloader(trainer))
    counts = []
    for _ in range(steps):
        seen = len(metrics["batch/samples_per_row"])
        for _ in range(args.gradient_accumulation_steps):
            next(microbatches)
        counts.append(sum(metrics["batch/samples_per_row"][seen:]))  # one row per micro-batch
    return counts, max(metrics["batch/row_tokens_max"])


@pytest.mark.parametrize("token_budget", [None, 100])
def test_an_optimizer_step_holds_prompts_per_step_x_g_samples(tmp_path, token_budget):
    """TRL's token-budget batcher fills a micro-batch with whatever fits; the mapping makes every
    optimizer step exactly prompts_per_step x G samples, with or without a token budget, and a
    budgeted micro-batch forwards at most token_budget tokens."""
    config = AsyncGRPOConfig(prompts_per_step=2, num_generations=4, token_budget=token_budget)
    job = TrlAsyncJobConfig(server_url="http://127.0.0.1:9")
    args = trl_config(config, job, tmp_path, "cpu", max_completion_length=12, prompt_tokens=20)
    counts, most_tokens = samples_per_optimizer_step(args, prompt=20, completions=[12, 3, 7, 12, 5])
    assert counts == [8, 8, 8]
    if token_budget:
        assert args.gradient_accumulation_steps == 4 and most_tokens <= token_budget


@pytest.mark.parametrize("command", ["train-trl-async", "train-async"])
def test_help_lists_the_flags(command, capsys):
    from grpo_lab.cli.main import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([command, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "--server-url" in text and "--max-staleness" in text and "--reward" in text


def test_without_vllm_the_job_says_what_to_do(tmp_path, monkeypatch):
    from grpo_lab.trl import async_trainer as trl_async

    assert "trl_stand_ins" not in str(trl_async.vllm_origin())  # on the job's path only
    monkeypatch.setattr(trl_async, "vllm_origin", lambda: None)  # as where vllm is missing
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
    weight sync a versioned adapter loaded on both replicas from the bucket, each step exactly
    2 prompts x 4 samples, a checkpoint every 2 steps. Then the job, restarted with the same
    command and --resume after losing its last checkpoint (preempted between checkpoints), goes
    on from step 2 with adapter names after the ones already published."""
    from grpo_lab.proxy.config import start_proxy_process
    from grpo_lab.serve.process import start_server_process

    out, bucket = tmp_path / "run", tmp_path / "bucket"
    serve = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 4}  # >= max_staleness + 2
    with start_server_process(str(chat_model_dir), **serve) as a, \
            start_server_process(str(chat_model_dir), **serve) as b, \
            start_proxy_process([a.url, b.url]) as proxy:
        path = [str(ROOT)] if REAL_VLLM else [str(ROOT), str(STAND_INS)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
               "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "TRL_EXPERIMENTAL_SILENCE": "1", "HF_HUB_OFFLINE": "1"}
        command = [sys.executable, "-m", "grpo_lab.cli", "train-trl-async",
                   "--server-url", proxy.url, "--output-dir", str(out), "--bucket", str(bucket),
                   "--model", str(chat_model_dir), "--dataset", str(chat_model_dir / "data"),
                   "--reward", "math_answer", "--system-prompt", SYSTEM_PROMPT,
                   "--prompts-per-step", "2", "--num-generations", "4",
                   "--max-new-tokens", "24", "--lora-rank", "2", "--learning-rate", "1e-3",
                   "--max-staleness", "1", "--checkpoint-every", "2"]
        run = subprocess.run([*command, "--steps", "3"], env=env, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        held = [{m["id"]: m["root"] for m in _get(r.url + "/v1/models")["data"] if m["parent"]}
                for r in (a, b)]
        stats = _get(proxy.url + "/proxy/stats")
        first = (out / "metrics.jsonl").read_text().splitlines()

        # a preemption after step 3, before its checkpoint reached the bucket
        checkpoint = out / "trl" / "checkpoint-2"
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        rollout_state = json.loads((checkpoint / "rollout_state.json").read_text())
        shutil.rmtree(out / "trl" / "checkpoint-3")
        resumed = subprocess.run([*command, "--steps", "4", "--resume"], env=env,
                                 capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        held_after = [{m["id"] for m in _get(r.url + "/v1/models")["data"] if m["parent"]}
                      for r in (a, b)]
        stats_after = _get(proxy.url + "/proxy/stats")

    summary = json.loads((out / "summary.json").read_text())
    # --- the first run
    assert [f"[step {s}/3]" in run.stdout for s in (1, 2, 3)] == [True] * 3
    records = [json.loads(line) for line in first]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["reward"]) for r in records)
    # every optimizer step held prompts_per_step x G samples, in one micro-batch (TRL counts)
    assert [(r["batch/samples_per_step"], r["batch/microbatches_per_step"])
            for r in records] == [(8, 1)] * 3
    # both replicas held the newest versions, loaded from the bucket; older ones were unloaded
    # (one version at train begin, then one per step: weight_sync_steps = 1)
    for adapters in held:
        assert set(adapters) == {f"{LORA_NAME}-v3", f"{LORA_NAME}-v4"}
        assert all(Path(root).parent == bucket.resolve() for root in adapters.values())
    # the completions came from the replicas, through the proxy, on both of them
    assert stats["completion_calls"] >= 3 * 2 * 4
    assert all(n > 0 for n in stats["routed"]) and sum(stats["errors"].values()) == 0
    assert stats["broadcasts"]["load_lora_adapter"] == 4
    assert stats["broadcasts"]["pause"] == stats["broadcasts"]["resume"] == 4
    assert stats["broadcasts"]["unload_lora_adapter"] == 2
    # TRL's checkpoint-2: its step, and the adapter version it had published
    assert state["global_step"] == 2 and rollout_state["model_version"] == 3
    # --- the resumed run: steps 3 and 4 only, from checkpoint-2's weights and state
    assert f"resuming from {checkpoint} (step 2)" in resumed.stdout
    assert [f"[step {s}/4]" in resumed.stdout for s in (1, 2, 3, 4)] == [False, False, True, True]
    assert summary["steps"] == 4 and summary["resumed_from_step"] == 2
    assert summary["trainer"] == "trl"
    assert summary["checkpoints"] == ["checkpoint-2", "checkpoint-4"]  # every 2 steps, the newest 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [json.dumps(r) for r in records[:2]] == first[:2]  # the first run's steps, kept
    assert all(r["batch/samples_per_step"] == 8 for r in records[2:])
    # v5 at train begin, v6 and v7 after steps 3 and 4: no name of the first run published again
    assert summary["version"] == 7
    assert all(adapters == {f"{LORA_NAME}-v6", f"{LORA_NAME}-v7"} for adapters in held_after)
    assert stats_after["broadcasts"]["load_lora_adapter"] == 4 + 3
    assert stats_after["broadcasts"]["unload_lora_adapter"] == 2 + 3  # v3, v4, v5
    assert sum(stats_after["errors"].values()) == 0
    assert (out / "adapter" / "adapter_config.json").exists()
    # the job imported the real vllm package wherever it is installed
    assert summary["vllm"] and ("trl_stand_ins" in summary["vllm"]) != REAL_VLLM


@pytest.mark.slow
def test_trl_async_trainer_with_real_vllm_replicas(chat_model_dir, tmp_path):
    """TRL's AsyncGRPOTrainer as the blog runs it, on this CPU: real vLLM replicas (its CPU
    build) behind `grpo-lab proxy`, the real `vllm` package in the trainer. TRL's adapter-only
    path accepts vLLM's /server_info, every version is loaded into both engines from the bucket,
    and each step holds the promised samples."""
    require_vllm()  # skips without vLLM; fails under GRPO_LAB_REQUIRE_VLLM=1
    from grpo_lab.proxy.config import start_proxy_process
    from grpo_lab.serve.process import start_vllm_process

    out, bucket = tmp_path / "run", tmp_path / "bucket"
    serve = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 3, "max_cpu_loras": 3,
             "logprobs_mode": "processed_logprobs"}
    with start_vllm_process(str(chat_model_dir), **serve) as a, \
            start_vllm_process(str(chat_model_dir), **serve) as b, \
            start_proxy_process([a.url, b.url]) as proxy:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
               "HF_HUB_OFFLINE": "1"}
        run = subprocess.run(
            [sys.executable, "-m", "grpo_lab.cli", "train-trl-async", "--server-url", proxy.url,
             "--output-dir", str(out), "--bucket", str(bucket), "--model", str(chat_model_dir),
             "--dataset", str(chat_model_dir / "data"), "--reward", "math_answer",
             "--system-prompt", SYSTEM_PROMPT, "--prompts-per-step", "2",
             "--num-generations", "4", "--max-new-tokens", "24", "--lora-rank", "2",
             "--learning-rate", "1e-3", "--max-staleness", "1", "--steps", "3"],
            env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        held = [{m["id"]: m["root"] for m in _get(r.url + "/v1/models")["data"] if m["parent"]}
                for r in (a, b)]
        stats = _get(proxy.url + "/proxy/stats")
        logs = [r.log_text() for r in (a, b)]
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["batch/samples_per_step"] == 8 for r in records)
    assert "trl_stand_ins" not in summary["vllm"] and summary["version"] == 4
    for adapters in held:  # vLLM holds the newest versions, read from the bucket
        assert set(adapters) == {f"{LORA_NAME}-v3", f"{LORA_NAME}-v4"}
        assert all(Path(root).parent == bucket.resolve() for root in adapters.values())
    for log in logs:  # vLLM's own log: every version loaded (pause, load, resume each sync)
        assert all(f"Loaded new LoRA adapter: name '{LORA_NAME}-v{v}'" in log for v in (1, 2, 3, 4))
    assert all(n > 0 for n in stats["routed"]) and sum(stats["errors"].values()) == 0
    assert stats["broadcasts"]["pause"] == stats["broadcasts"]["resume"] == 4
