"""Benchmark grpo_lab at real models' shapes on the CPU: random weights, published configs, no hub.

    python benchmarks/real_shapes.py                   # LoRA: ~10 min on 2 quiet cores (estimate)
    python benchmarks/real_shapes.py --modes lora,full # + full fine-tuning: ~20 min, ~19 GiB
    OMP_NUM_THREADS=1 python benchmarks/real_shapes.py --threads 1 --repeats 2 --gen-prompts 4 \\
        --gen-tokens 16 --prompts 1 --generations 2 --max-new-tokens 8 --steps 2 \\
        --out /tmp/real_shapes.json                     # a smoke run: 1.5 min

Models: grpo_lab.model.shaped_models (built once into the cache, seconds): the "vocab-only" shape
(Qwen2.5's 151,936-row vocabulary on a 64-wide, 2-layer body) and Qwen2.5-0.5B. Each measurement
runs in a process of its own (`--one NAME`), so its peak resident memory (`ru_maxrss`) is its own;
every process imports the same libraries first, and reports its memory after the imports, after
loading the model (`ready`) and at the end (`peak`), and the wall seconds of the measured work.

    a. generation, vocab-only shape, --gen-prompts prompts x --gen-tokens new tokens, one
       sequence each: `model.generate` alone (sampling, no scores kept: the floor), grpo_lab's
       `generate_completions` (sampling, with each token's logprob) and `greedy_accuracy`.
       Goal: each at most 1.2x the floor's peak memory and time (median of --repeats).
    b. one synchronous GRPO step at Qwen2.5-0.5B's shape, --prompts prompts x G = --generations,
       up to --max-new-tokens, LoRA rank --lora-rank and/or full fine-tuning (--modes): grpo_lab's
       `GRPOTrainer.step()` against TRL's `GRPOTrainer` (use_vllm=False: transformers' generate)
       on the same model, word problems in the same order, G, lengths, temperature, loss, clip,
       learning rate, AdamW settings, beta = 0, activation checkpointing as --checkpointing.
       Goals (issue 33): grpo_lab's peak memory <= TRL's, its step time <= 0.8x TRL's (median
       over --steps; the first step is in it).
    c. grpo_lab.model.memory_model's estimate of each step in (b) beside its measurement (the
       model against the peak above the imports), and of the blog's recipe (Qwen2.5-Math-1.5B,
       bfloat16, LoRA r=1, 16 prompts x 8, 3,000 new tokens in a 4,096 context, 16,384-token
       micro-batches, no activation checkpointing) on a GPU.

Equal lengths: with random weights a completion almost never samples <|im_end|> (1 id in
151,936), so every completion runs to the cap; to make that certain on both sides every process
sets `model.generation_config.min_new_tokens` to the cap (transformers fills the unset fields of
grpo_lab's and TRL's generation configs from it), and the completion lengths are recorded.
A step that the memory model predicts beyond 90 % of the machine's available memory is skipped
with the reason (`--force` runs it anyway). The memory model counts grpo_lab's logits in its
chunks (grpo_lab.algo.logprobs) and TRL's whole; the guard takes the larger.
Results go to benchmarks/results/real_shapes.json (or --out) and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from grpo_lab.algo.logprobs import chunk_positions  # noqa: E402
from grpo_lab.model.memory_model import GiB, MiB, StepSetting, step_memory  # noqa: E402
from grpo_lab.model.shaped_models import QWEN25_05B, QWEN25_MATH_15B, SHAPES  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "real_shapes.json"
GOALS = {"generation_ratio": 1.2, "step_memory_ratio": 1.0, "step_time_ratio": 0.8}
GENERATION = ("generate", "completions", "greedy")
BLOG = StepSetting(prompts=16, num_generations=8, prompt_tokens=1096, completion_tokens=3000,
                   dtype="bfloat16", lora_rank=1, micro_batch_rows=4,
                   logits_chunk_rows=chunk_positions(QWEN25_MATH_15B.vocab_size),
                   generate_in_process=False)
"""The blog's trainer (docs/recipe.md, run 3 on): 128 completions, up to 3,000 new tokens in a
4,096 context (prompts taken at the rest, 1,096: the worst case), 16,384-token micro-batches (4
full-length rows), no activation checkpointing, sampling on separate vLLM replicas; the LM head in
grpo_lab.algo.logprobs's chunks (2^24 logits: 110 positions)."""


def rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("inf")


# ---------------------------------------------------------------- one measurement per process

def import_all():
    """Every library any measurement uses, so that all processes start from the same memory."""
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch
    import trl  # noqa: F401

    import grpo_lab.train.trainer  # noqa: F401
    return torch


def load(shape: str, cap: int):
    from grpo_lab.model.models import load_model_and_tokenizer
    from grpo_lab.model.shaped_models import shaped_model_path

    model, tokenizer = load_model_and_tokenizer(shaped_model_path(shape))
    model.generation_config.min_new_tokens = cap  # every completion runs to the cap
    return model, tokenizer


def problems_of(path, n: int, split: str = "test"):
    from grpo_lab.model.chat_model import as_problems
    from grpo_lab.model.shaped_models import dataset_files
    from grpo_lab.util.files import read_jsonl

    return as_problems(read_jsonl(dataset_files(path)[split]))[:n]


def measure_generation(name: str, args) -> dict:
    """(a): one of GENERATION on the vocab-only shape; returns times and lengths."""
    import torch

    from grpo_lab.data.prompts import encode_prompts
    from grpo_lab.data.rewards import math_answer_reward
    from grpo_lab.model.evaluation import greedy_accuracy
    from grpo_lab.model.generation import generate_completions, sampling_config
    from grpo_lab.model.shaped_models import shaped_model_path

    model, tokenizer = load("vocab-only", args.gen_tokens)
    problems = problems_of(shaped_model_path("vocab-only"), args.gen_prompts)

    def run(batch, tokens: int) -> int:  # -> new tokens of the longest completion
        if name == "completions":
            out = generate_completions(model, tokenizer, [p.prompt for p in batch],
                                       max_new_tokens=tokens)
            return max(len(c) for c in out.completion_ids)
        if name == "greedy":
            greedy_accuracy(model, tokenizer, batch, max_new_tokens=tokens,
                            reward_fn=math_answer_reward, batch_size=len(batch))
            return tokens  # min_new_tokens: greedy completions run to the cap too
        ids = encode_prompts(tokenizer, [p.prompt for p in batch])
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        config = sampling_config(tokenizer, tokens)
        config.output_scores = config.return_dict_in_generate = False  # the floor: no scores
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask,
                                 generation_config=config)
        return out.shape[1] - width

    torch.manual_seed(0)
    run(problems[:1], 2)  # warm-up: first-call costs out of the timing
    ready = rss_mib()
    times, lengths = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        lengths.append(run(problems, args.gen_tokens))
        times.append(time.perf_counter() - start)
    return {"ready_mib": ready, "seconds": statistics.median(times), "all_seconds": times,
            "new_tokens": max(lengths)}


def grpo_lab_config(args, mode: str):
    from grpo_lab.model.shaped_models import dataset_files, shaped_model_path
    from grpo_lab.train.config import GRPOConfig

    path = shaped_model_path(args.shape)
    files = dataset_files(path)
    return GRPOConfig(
        model=str(path), dataset=str(files["train"]), eval_split=str(files["test"]),
        reward="math_answer", steps=args.steps, prompts_per_step=args.prompts,
        num_generations=args.generations, max_completion_length=args.max_new_tokens,
        use_lora=mode == "lora", lora_rank=args.lora_rank, learning_rate=args.lr,
        gradient_checkpointing=args.checkpointing, device="cpu", dtype="float32",
        num_threads=args.threads, seed=args.seed, eval_every=0, log_every=10**6,
        progress=False, log_completions_every=0)


def measure_grpo_lab_step(mode: str, args) -> dict:
    """(b): `args.steps` steps of grpo_lab's GRPOTrainer, each timed."""
    from grpo_lab.train.trainer import GRPOTrainer

    config = grpo_lab_config(args, mode)
    model, tokenizer = load(args.shape, args.max_new_tokens)
    trainer = GRPOTrainer(config, model=model, tokenizer=tokenizer)
    ready, times, records = rss_mib(), [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        records.append(trainer.step())
        times.append(time.perf_counter() - start)
    return {"ready_mib": ready, "step_seconds": times,
            "completion_mean_length": [r["completions/mean_length"] for r in records],
            "generate_seconds": [r["perf/generate_s"] for r in records],
            "fwd_bwd_seconds": [r["perf/fwd_bwd_s"] for r in records],
            "trainable_parameters": trainer.num_trainable}


def measure_trl_step(mode: str, args) -> dict:
    """(b): `args.steps` steps of TRL's GRPOTrainer on the same prompts, each timed."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    from grpo_lab.data.prompts import encode_prompts
    from grpo_lab.data.rewards import math_answer_reward

    config = grpo_lab_config(args, mode)
    task = config.make_task()
    # grpo_lab's trainer draws each step's prompts from Random(seed) in turn: the same draws.
    problems = task.sample_batch(random.Random(config.seed), args.steps * args.prompts)
    model, tokenizer = load(args.shape, args.max_new_tokens)
    conversations = [[{"role": "user", "content": p.prompt}] for p in problems]
    trl_ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
               for c in conversations]
    assert trl_ids == encode_prompts(tokenizer, [p.prompt for p in problems]), \
        "TRL and grpo_lab would see different prompt ids"
    dataset = Dataset.from_list([{"prompt": c, "answer": p.answer}
                                 for c, p in zip(conversations, problems)])
    run_dir = tempfile.mkdtemp(prefix="grpo_lab_real_shapes_trl_")
    trl_args = TRLConfig(
        output_dir=run_dir, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        activation_checkpointing=args.checkpointing, max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=config.temperature, loss_type=config.loss_type,
        scale_rewards="group" if config.scale_rewards else "none",
        epsilon=config.epsilon_low, epsilon_high=config.epsilon_high, beta=config.beta,
        num_iterations=config.num_iterations, learning_rate=config.learning_rate,
        lr_scheduler_type="constant", weight_decay=config.weight_decay,
        adam_beta2=config.adam_beta2, max_grad_norm=config.max_grad_norm, seed=config.seed,
        shuffle_dataset=False, logging_steps=1, disable_tqdm=True)
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.effective_lora_alpha,
                      target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = TRLTrainer(model=model, reward_funcs=math_answer_reward, args=trl_args,
                         train_dataset=dataset, processing_class=tokenizer,
                         peft_config=lora if mode == "lora" else None)
    trainer.remove_callback(PrinterCallback)
    times, lengths = [], []

    class Timer(TrainerCallback):  # a step: generation, scoring, forward, backward, update
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    trainer.add_callback(Timer())
    ready = rss_mib()
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"ready_mib": ready, "step_seconds": times, "completion_mean_length": lengths,
            "trainable_parameters": trainable}


def run_one(args) -> dict:
    """The measurement `args.one`, in this process; its result with this process's memory."""
    started = time.perf_counter()
    torch = import_all()
    torch.set_num_threads(args.threads)
    imports = rss_mib()
    if args.one == "build":
        from grpo_lab.model.shaped_models import build_info, shaped_model_path

        result = {shape: build_info(shaped_model_path(shape))
                  for shape in ("vocab-only", args.shape)}
    elif args.one in GENERATION:
        result = measure_generation(args.one, args)
    else:
        trainer, mode = args.one.split(":")
        measure = measure_grpo_lab_step if trainer == "grpo_lab" else measure_trl_step
        result = measure(mode, args)
    return {**result, "import_mib": imports, "peak_mib": rss_mib(),
            "process_s": time.perf_counter() - started}


# ---------------------------------------------------------------- the parent: run, compare

SHARED = ("threads", "seed", "repeats", "gen_prompts", "gen_tokens", "shape", "prompts",
          "generations", "max_new_tokens", "steps", "lora_rank", "lr")
"""Options every measurement process receives as given to the parent."""


def spawn(name: str, args, scratch: Path) -> dict:
    """Run measurement `name` in a process of its own; its result, or why there is none."""
    result_file = scratch / f"{name.replace(':', '-')}.json"
    cmd = [sys.executable, __file__, "--one", name, "--result", str(result_file)]
    for option in SHARED:
        cmd += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    cmd += ["--checkpointing"] if args.checkpointing else []
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    print(f"{name} ...", end=" ", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"failed (exit {done.returncode})", flush=True)
        return {"error": done.stderr[-3000:], "returncode": done.returncode}
    result = json.loads(result_file.read_text())
    result["wall_s"] = time.perf_counter() - start
    print(f"peak {result['peak_mib']:,.0f} MiB, {result['wall_s']:.0f} s", flush=True)
    return result


def step_setting(args, mode: str, prompt_tokens: int) -> StepSetting:
    return StepSetting(prompts=args.prompts, num_generations=args.generations,
                       prompt_tokens=prompt_tokens, completion_tokens=args.max_new_tokens,
                       lora_rank=args.lora_rank if mode == "lora" else None,
                       activation_checkpointing=args.checkpointing)


def longest_prompt(args) -> int:
    """The longest chat-formatted prompt of the word problems (tokens): the model's P."""
    from transformers import AutoTokenizer

    from grpo_lab.data.prompts import encode_prompts
    from grpo_lab.model.shaped_models import shaped_model_path

    path = shaped_model_path(args.shape)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return max(map(len, encode_prompts(tokenizer, [p.prompt for p in problems_of(path, 10**6,
                                                                                  "train")])))


def ratio(a: dict, b: dict, key: str) -> float | None:
    return a[key] / b[key] if key in a and key in b else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="(a): timed runs, the median")
    parser.add_argument("--gen-prompts", type=int, default=32, help="(a): prompts")
    parser.add_argument("--gen-tokens", type=int, default=128, help="(a): new tokens")
    parser.add_argument("--shape", default=QWEN25_05B.name, choices=sorted(SHAPES),
                        help="(b): the model's shape")
    parser.add_argument("--modes", default="lora", help="(b): lora, full or lora,full")
    parser.add_argument("--prompts", type=int, default=2, help="(b): prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="(b): G")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="(b): completion cap")
    parser.add_argument("--steps", type=int, default=2, help="(b): steps per trainer")
    parser.add_argument("--lora-rank", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--checkpointing", action="store_true",
                        help="(b): activation checkpointing on both sides")
    parser.add_argument("--skip", default="", help="parts to leave out: a, b or a,b")
    parser.add_argument("--force", action="store_true",
                        help="run steps predicted beyond the available memory")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # in a measurement's own process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        args.result.write_text(json.dumps(run_one(args)))
        return 0

    started = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))
    out = {"settings": {k: v for k, v in vars(args).items() if k not in ("one", "result", "out")},
           "goals": GOALS, "cpu_count": os.cpu_count(), "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="grpo_lab_real_shapes_") as scratch:
        out["build"] = spawn("build", args, Path(scratch))  # builds once, outside the timings
        if "error" in out["build"]:
            print(out["build"]["error"])
            return 1
        if "a" not in skip:
            out["generation"] = {name: spawn(name, args, Path(scratch)) for name in GENERATION}
        if "b" not in skip:
            out["steps"], out["memory_model"] = {}, {}
            prompt_tokens = longest_prompt(args)
            for mode in args.modes.split(","):
                # grpo_lab's head runs in chunks (core.logprobs), TRL's on whole logits.
                setting = step_setting(args, mode, prompt_tokens)
                estimates = {
                    "grpo_lab": step_memory(SHAPES[args.shape], replace(
                        setting, logits_chunk_rows=chunk_positions(SHAPES[args.shape].vocab_size)),
                        label=f"{args.shape} {mode}, grpo_lab"),
                    "trl": step_memory(SHAPES[args.shape], replace(setting, logits_chunk_rows=None),
                                       label=f"{args.shape} {mode}, TRL")}
                out["memory_model"][mode] = {name: {"total_mib": m.total / MiB, "table": str(m)}
                                             for name, m in estimates.items()}
                estimate = max(estimates.values(), key=lambda m: m.total)  # for the guard
                room = available_mib()
                for trainer in ("grpo_lab", "trl"):
                    name = f"{trainer}:{mode}"
                    if estimate.total / MiB > 0.9 * room and not args.force:
                        out["steps"][name] = {"skipped": f"the memory model predicts "
                                              f"{estimate.total / GiB:.1f} GiB; "
                                              f"{room / 1024:.1f} GiB available (--force)"}
                        continue
                    out["steps"][name] = spawn(name, args, Path(scratch))
    out["blog"] = {name: {"total_gib": m.total / GiB, "table": str(m)} for name, m in blog_rows()}
    out["loadavg_after"] = os.getloadavg()
    out["summary"], out["met"] = summarise(out)
    out["benchmark_s"] = round(time.perf_counter() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    report(out)
    print(f"wrote {args.out}")
    return 0


def blog_rows():
    """The memory model at the blog's recipe (BLOG), and two variations of it."""

    shape = QWEN25_MATH_15B
    return [("blog trainer", step_memory(shape, BLOG, "Qwen2.5-Math-1.5B, the blog's trainer")),
            ("logits whole", step_memory(shape, replace(BLOG, logits_chunk_rows=None),
                                         "the same, the LM head over a whole micro-batch")),
            ("sampling in process", step_memory(
                shape, replace(BLOG, generate_in_process=True),
                "the same trainer also sampling its 128 completions (KV cache)"))]


def summarise(out: dict) -> tuple[dict, dict]:
    """Ratios against the floors (a) and TRL (b), the model against measurement (c), goals."""
    summary, met = {}, {}
    gen = out.get("generation", {})
    floor = gen.get("generate", {})
    for name in ("completions", "greedy"):
        row = gen.get(name, {})
        mem, sec = ratio(row, floor, "peak_mib"), ratio(row, floor, "seconds")
        if mem is not None and sec is not None:
            summary[f"{name}_vs_generate"] = {"peak": mem, "seconds": sec}
            met[f"{name}_within_1.2x"] = max(mem, sec) <= GOALS["generation_ratio"]
    steps = out.get("steps", {})
    for mode in {name.split(":")[1] for name in steps}:
        ours, theirs = steps.get(f"grpo_lab:{mode}", {}), steps.get(f"trl:{mode}", {})
        row = {}
        if "step_seconds" in ours and "step_seconds" in theirs:
            row["peak_ratio"] = ours["peak_mib"] / theirs["peak_mib"]
            row["time_ratio"] = (statistics.median(ours["step_seconds"])
                                 / statistics.median(theirs["step_seconds"]))
            met[f"{mode}_memory"] = row["peak_ratio"] <= GOALS["step_memory_ratio"]
            met[f"{mode}_time"] = row["time_ratio"] <= GOALS["step_time_ratio"]
        for name, measured in (("grpo_lab", ours), ("trl", theirs)):
            if "peak_mib" in measured:  # the model against the peak above the imports
                model_mib = out["memory_model"][mode][name]["total_mib"]
                row[f"model_vs_{name}"] = model_mib / (measured["peak_mib"]
                                                       - measured["import_mib"])
        summary[mode] = row
    return summary, met


def report(out: dict) -> None:
    print(f"\n{'measurement':<22}{'imports':>10}{'ready':>10}{'peak MiB':>10}{'seconds':>10}"
          f"{'tokens':>8}")
    rows = [(n, r) for n, r in out.get("generation", {}).items()]
    rows += [(n, r) for n, r in out.get("steps", {}).items()]
    for name, r in rows:
        if "peak_mib" not in r:
            print(f"{name:<22}{r.get('skipped') or r.get('error', '')[-300:]}")
            continue
        seconds = r.get("seconds") or statistics.median(r["step_seconds"])
        tokens = r.get("new_tokens") or max(r["completion_mean_length"] or [0])
        print(f"{name:<22}{r['import_mib']:>10.0f}{r['ready_mib']:>10.0f}{r['peak_mib']:>10.0f}"
              f"{seconds:>10.2f}{tokens:>8.0f}")
    print("\n" + json.dumps(out["summary"], indent=2))
    for mode, estimates in out.get("memory_model", {}).items():
        for m in estimates.values():
            print(f"\nmemory model, the step above ({mode}):\n{m['table']}")
    for name, m in out["blog"].items():
        print(f"\n{m['table']}" if name == "blog trainer" else f"{name}: {m['total_gib']:.1f} GiB")
    print("\ngoals met: " + json.dumps(out["met"]))


if __name__ == "__main__":
    sys.exit(main())
