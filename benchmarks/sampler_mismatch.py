"""How far the sampler's log-probabilities are from the trainer's, per engine and dtype.

    python benchmarks/sampler_mismatch.py              # grpo-lab serve + vLLM fp32, bf16, fp16
    python benchmarks/sampler_mismatch.py --dtypes float32 --prompts 8
    python benchmarks/sampler_mismatch.py --model smollm2-135m --prompts 8
                                                       # the real model (its own results file)

The tiny model (or `--model smollm2-135m`, SmolLM2-135M-Instruct on the `sum_form` task's
chat-templated prompts: a 49,152-token vocabulary) with a random rank-1 LoRA adapter (the
course's policy, notebook 05's `change_weights` scale) is served by real vLLM's CPU build once
per dtype it offers here, and by `grpo-lab serve` (float32). Each engine samples the same seeded
requests at T = 0.7 with processed logprobs and no top-k / top-p; the trainer (transformers +
peft, float32, `policy_logprobs`) scores the SAME tokens. Two request shapes: `natural` (stop at
EOS, the course's completions) and `long` (`ignore_eos`, 48 tokens: a sequence's ratio is a
product over its tokens).

Reported per engine and shape, with diff = log pi_trainer - log pi_sampler on real tokens:
  token |diff|             mean, p99, max
  sequence ratio           exp(sum_t diff): min, max (TRL's sequence-level weight before clipping)
  kl_k3                    k3 estimate of KL(pi_sampler || pi_trainer) (TRL AsyncGRPO's `kl`)
  correction               what TRL's importance-sampling modes (clip_max 3.0, no clip_min) do
                           to these samples: share of sequences (sequence_*) or tokens (token_*)
                           masked or truncated (grpo_lab.algo.sampler_correction), and TRL's
                           `sampling/*` metrics of the default, sequence_mask
  same_tokens              share of completions whose token ids equal grpo-lab serve's (same
                           seed: child i of a request samples with seed + i on both engines)
  repeat                   the `long` request sent again to the same server: share of identical
                           completions, and max |logprob change| on those (is the engine
                           deterministic?)
Results go to benchmarks/results/sampler_mismatch.json and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from grpo_lab.algo.logprobs import policy_logprobs  # noqa: E402
from grpo_lab.algo.sampler_correction import (  # noqa: E402
    IS_MODES,
    sampler_correction_metrics,
    sampler_importance_weights,
    sampler_kl,
)
from grpo_lab.bucket.adapters import write_random_adapter  # noqa: E402
from grpo_lab.data.prompts import encode_prompts  # noqa: E402
from grpo_lab.data.tasks import (
    AdditionTask,  # noqa: E402
    make_task,  # noqa: E402
)
from grpo_lab.model.models import (
    load_model_and_tokenizer,  # noqa: E402
    model_folder,  # noqa: E402
)
from grpo_lab.serve.client import BlockingClient  # noqa: E402
from grpo_lab.serve.process import (  # noqa: E402
    start_server_process,  # noqa: E402
    start_vllm_process,
    vllm_missing_reason,
)
from grpo_lab.train.rollout_batch import pad_left, pad_right

TEMPERATURE = 0.7
CLIP_MAX = 3.0  # TRL's vllm_importance_sampling_cap default
SHAPES = {"natural": dict(max_tokens=16), "long": dict(max_tokens=48, ignore_eos=True)}
SERVE_FLAGS = dict(enable_lora=True, max_lora_rank=8, max_loras=1,
                   logprobs_mode="processed_logprobs")


def sample(client: BlockingClient, prompts: list[list[int]], n: int, seed: int) -> dict:
    """Each shape's choices from one seeded request per shape, under the adapter's name."""
    return {shape: client.completions(prompts, model="policy-v1", n=n, seed=seed,
                                      temperature=TEMPERATURE, **kwargs)["choices"]
            for shape, kwargs in SHAPES.items()}


def mismatch(trainer_model, choices: list[dict], pad_id: int) -> dict:
    """Score the sampled tokens with the trainer; the figures of the module docstring."""
    p_ids, p_mask = pad_left([c["prompt_token_ids"] for c in choices], pad_id)
    c_ids, c_mask = pad_right([c["token_ids"] for c in choices], pad_id)
    sampler, _ = pad_right([c["logprobs"]["token_logprobs"] for c in choices], 0.0)
    sampler = sampler.float()
    with torch.no_grad():
        trainer = policy_logprobs(trainer_model, p_ids, p_mask, c_ids, c_mask, TEMPERATURE)
    mask = c_mask.float()
    real = c_mask.bool()
    diff = (trainer - sampler)[real]  # (N,) log pi_trainer - log pi_sampler, real tokens
    seq_ratio = torch.exp(((trainer - sampler) * mask).sum(-1))  # (B,)
    correction = {}
    for mode in IS_MODES:
        weights = sampler_importance_weights(trainer, sampler, mask, mode, clip_max=CLIP_MAX)
        raw = sampler_importance_weights(trainer, sampler, mask, mode, clip_max=float("inf"))
        changed = weights != raw  # (B, 1) per sequence, (B, T) per token
        changed = changed if mode.startswith("sequence") else changed[real]
        correction[mode] = round(changed.float().mean().item(), 6)
    defaults = sampler_importance_weights(trainer, sampler, mask, "sequence_mask", CLIP_MAX)
    return {
        "completions": len(choices), "tokens": int(real.sum()),
        "mean_length": round(real.sum().item() / len(choices), 2),
        "token_abs_diff": {"mean": diff.abs().mean().item(),
                           "p99": diff.abs().quantile(0.99).item(),
                           "max": diff.abs().max().item()},
        "sequence_ratio": {"min": seq_ratio.min().item(), "max": seq_ratio.max().item()},
        "kl_k3": sampler_kl(trainer, sampler, mask),
        "correction_share_affected": correction,
        "sequence_mask_metrics": sampler_correction_metrics(trainer, sampler, defaults, mask,
                                                            "sequence_mask"),
    }


def same_tokens(choices: list[dict], reference: list[dict]) -> float:
    return sum(a["token_ids"] == b["token_ids"] for a, b in zip(choices, reference, strict=True)) \
        / len(reference)


def repeat(again: list[dict], first: list[dict]) -> dict:
    """The same seeded request twice on one server: same tokens? same logprobs on those?"""
    same = [(a, b) for a, b in zip(again, first, strict=True) if a["token_ids"] == b["token_ids"]]
    change = max((abs(x - y) for a, b in same for x, y in zip(
        a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True)),
        default=0.0)
    return {"same_tokens": len(same) / len(first), "max_logprob_change": change}


def run_engine(engine: str, dtype: str, adapter: Path, prompts, n: int, seed: int,
               model: str = "tiny") -> dict:
    """Start one engine, load the adapter as `policy-v1`, sample both shapes, stop it."""
    start = time.monotonic()
    log = Path(tempfile.gettempdir()) / f"sampler_mismatch_{engine}_{dtype}.log"
    if engine == "vllm":
        process = start_vllm_process(model, dtype=dtype, log_path=log, **SERVE_FLAGS)
    else:
        process = start_server_process(model, dtype=dtype, log_path=log, **SERVE_FLAGS)
    with process, BlockingClient(process.url) as client:
        startup_s = time.monotonic() - start
        served_dtype = client.server_info()["model_config"]["dtype"]
        client.load_lora_adapter("policy-v1", str(adapter))
        start = time.monotonic()
        choices = sample(client, prompts, n, seed)
        sample_s = time.monotonic() - start
        again = sample(client, prompts, n, seed)["long"]
    return {"engine": engine, "dtype": dtype, "served_dtype": served_dtype,
            "startup_s": round(startup_s, 1), "sample_s": round(sample_s, 2), "choices": choices,
            "repeat": repeat(again, choices["long"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"),
                        help="the tiny model on addition, or SmolLM2-135M-Instruct on sum_form")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16",
                        help="vLLM's dtypes to try; one that fails to start is reported as such")
    parser.add_argument("--prompts", type=int, default=32, help="addition prompts per request")
    parser.add_argument("--n", type=int, default=8, help="completions per prompt (a GRPO group)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path,
                        default=None, help="default: results/sampler_mismatch.json, "
                        "results/sampler_mismatch_smollm2.json for the real model")
    args = parser.parse_args(argv)
    real = args.model != "tiny"
    args.out = args.out or Path(__file__).parent / "results" / (
        "sampler_mismatch_smollm2.json" if real else "sampler_mismatch.json")
    torch.set_num_threads(1)
    base, tokenizer = load_model_and_tokenizer(model_folder(args.model, progress=False))
    if real:  # its conversations, through the chat template, as the trainer sends them
        problems = make_task("sum_form", 30).sample_batch(random.Random(args.seed), args.prompts)
        prompts = encode_prompts(tokenizer, [p.prompt for p in problems])
    else:
        prompts = [tokenizer(p.prompt)["input_ids"]
                   for p in AdditionTask().sample_batch(random.Random(args.seed), args.prompts)]

    engines = [("grpo-lab serve", "float32")]
    missing = vllm_missing_reason()
    if missing is None:
        engines += [("vllm", dtype) for dtype in args.dtypes.split(",") if dtype]
    results = {"model": args.model, "temperature": TEMPERATURE, "clip_max": CLIP_MAX,
               "lora_rank": 1,
               "prompts": args.prompts, "n": args.n, "seed": args.seed,
               "shapes": {k: {**v} for k, v in SHAPES.items()}, "vllm_missing": missing,
               "threads": 1, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trainer_model = write_random_adapter(base, Path(tmp) / "policy-v1", seed=args.seed)
        reference = None
        for engine, dtype in engines:
            key = f"{engine} {dtype}"
            print(f"{key}: starting", flush=True)
            try:
                run = run_engine(engine, dtype, Path(tmp) / "policy-v1", prompts, args.n,
                                 args.seed, args.model)
            except RuntimeError as exc:  # a dtype this CPU build refuses
                results["engines"][key] = {"error": str(exc).strip().splitlines()[-1][:300]}
                print(f"{key}: did not start: {results['engines'][key]['error']}")
                continue
            choices = run.pop("choices")
            reference = reference or choices  # grpo-lab serve's, the first engine
            run["shapes"] = {shape: {**mismatch(trainer_model, choices[shape],
                                                tokenizer.pad_token_id),
                                     "same_tokens": same_tokens(choices[shape], reference[shape])}
                             for shape in SHAPES}
            results["engines"][key] = run
            print(f"  repeat of the long request: {run['repeat']['same_tokens']:.2f} identical, "
                  f"max |logprob change| {run['repeat']['max_logprob_change']:.2e}")
            for shape, m in run["shapes"].items():
                d, r = m["token_abs_diff"], m["sequence_ratio"]
                c = m["correction_share_affected"]
                print(f"  {shape:>7}: |diff| mean {d['mean']:.2e} p99 {d['p99']:.2e} max "
                      f"{d['max']:.2e} | seq ratio {r['min']:.4f}..{r['max']:.4f} | k3 "
                      f"{m['kl_k3']:.2e} | masked seq {c['sequence_mask']:.3f} | truncated tok "
                      f"{c['token_truncate']:.4f} | same tokens {m['same_tokens']:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
