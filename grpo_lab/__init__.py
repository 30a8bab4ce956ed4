"""grpo_lab: GRPO from a single process on a CPU to asynchronous LoRA training across jobs.

Folders by role, in import order: a module imports its own folder and those above
(docs/internals.md; tests/test_layout.py checks it).

    util/      argv values, atomic folders, JSON Lines, process groups, devices
    data/      tasks, dataset files, prompts and chat templates, rewards
    algo/      GRPO on tensors: advantages, the clipped loss, KL, logprobs, micro-batches
    model/     the tiny, chat and real models; sampling; held-out evaluation
    bucket/    the folder all jobs share: adapters published atomically, checkpoints
    watch/     metrics.jsonl and its names, reporters, the run doctor, plots, the dashboard
    serve/     `grpo-lab serve` (vLLM's HTTP API on a CPU), its client; vLLM as a process
    proxy/     `grpo-lab proxy`: replicas behind one URL, KV-prefix routing
    rollout/   the rollout buffer and generators, in process or over HTTP
    train/     GRPOConfig and the trainers, synchronous and asynchronous; the trainer job
    trl/       beside TRL (the `trl` extra): its async trainer as a job, the doctor's callback
    launch/    the recipe's jobs as a plan, run locally or on HF Jobs; preflight
    plan/      flavors, the pipeline simulator and the planner
    cli/       the `grpo-lab` command and the demos

The course's notebook helpers are not here: they are the separate package `grpo_lab_course`.

The public API (docs/api.md): the building blocks named in `__all__` are attributes of the
package, imported on first use (PEP 562), so `import grpo_lab` stays light; `grpo_lab.ProxyConfig`
imports grpo_lab.proxy.config and nothing of torch. Use them as `import grpo_lab as gl`:
four names are TRL's too (`gl.GRPOTrainer` vs `trl.GRPOTrainer`).
"""

import importlib

__version__ = "0.1.0"

ROLES = ("util", "data", "algo", "model", "bucket", "watch", "serve", "proxy", "rollout", "train",
         "trl", "launch", "plan", "cli")
"""The folders by role in import order: a module may import its own folder and those before it."""

_EXPORTS = {
    # The GRPO loss and its parts, tensors in and out (docs/api.md, "The loss")
    "grpo_lab.algo.grpo_loss": (
        "grpo_loss", "group_advantages", "clipped_surrogate", "SurrogateOutput", "k3_kl",
        "aggregate", "grpo_aggregate", "dapo_aggregate", "dr_grpo_aggregate", "LOSS_TYPES",
        "masked_mean"),
    "grpo_lab.algo.logprobs": (
        "selective_logprobs", "model_logprobs", "token_logprobs", "token_logprobs_and_entropy",
        "policy_logprobs", "policy_logprobs_and_entropy"),
    "grpo_lab.algo.sampler_correction": (
        "sampler_importance_weights", "sampler_kl", "sampler_correction_metrics", "IS_MODES"),
    # A step's batch and its micro-batches
    "grpo_lab.train.rollout_batch": ("pad_left", "pad_right", "RolloutBatch"),
    "grpo_lab.algo.packing": (
        "make_micro_batches", "accumulate_grpo_loss", "MicroBatch", "PaddedMicroBatch",
        "PackedMicroBatch", "block_causal_mask"),
    "grpo_lab.algo.shared_prompt": (
        "layout_micro_batches", "shared_prompt_mask", "supports_shared_prompt"),
    # Rollouts: the buffer and the generators
    "grpo_lab.rollout.buffer": ("RolloutBuffer",),
    "grpo_lab.rollout.generators": ("Generator", "LocalGenerator"),
    "grpo_lab.rollout.http_generator": ("HTTPGenerator",),
    "grpo_lab.data.completions": ("Completions",),
    # The bucket, the servers, their client
    "grpo_lab.bucket.adapters": ("AdapterBucket", "adapter_name"),
    "grpo_lab.bucket.checkpoint": ("Checkpoints",),
    "grpo_lab.serve.client": ("InferenceClient", "BlockingClient", "ServerError"),
    "grpo_lab.serve.process": ("start_server_process", "start_vllm_process"),
    # The proxy and its router
    "grpo_lab.proxy.config": ("ProxyConfig", "start_proxy_process"),
    "grpo_lab.proxy.app": ("Proxy", "make_app", "serve_proxy"),
    "grpo_lab.proxy.router": ("PrefixRouter", "RouterConfig", "RouteDecision",
                              "NoReplicaAvailable"),
    # The trainers and their configs
    "grpo_lab.train.config": ("GRPOConfig",),
    "grpo_lab.train.trainer": ("GRPOTrainer",),
    "grpo_lab.train.async_config": ("AsyncGRPOConfig",),
    "grpo_lab.train.async_trainer": ("AsyncGRPOTrainer",),
    # The run doctor: silent failures named from the metrics (also as a TRL callback)
    "grpo_lab.watch.doctor": ("Doctor", "Finding"),
    "grpo_lab.trl.doctor_callback": ("DoctorCallback",),
    # Models, tasks, datasets, rewards
    "grpo_lab.model.models": ("load_model_and_tokenizer", "model_folder", "MADE_MODELS"),
    "grpo_lab.model.pretrained": ("smollm2_path",),
    "grpo_lab.model.tiny_model": ("tiny_model_path",),
    "grpo_lab.model.chat_model": ("chat_model_path",),
    "grpo_lab.data.prompts": ("encode_prompts",),
    "grpo_lab.data.tasks": ("Task", "Problem", "AdditionTask", "SortTask", "make_task"),
    "grpo_lab.data.datasets": ("DatasetTask", "load_dataset_task"),
    "grpo_lab.data.rewards": (
        "exact_match_reward", "partial_match_reward", "math_answer_reward", "format_reward",
        "extract_final_answer", "REWARDS"),
    "grpo_lab.data.reward_set": ("RewardSet",),
    # Real models' shapes and the memory of a step
    "grpo_lab.model.shaped_models": (
        "ModelShape", "SHAPES", "QWEN25_05B", "QWEN25_MATH_15B", "shaped_model_path",
        "random_model"),
    "grpo_lab.model.memory_model": (
        "StepSetting", "StepMemory", "step_memory", "num_parameters", "lora_parameters"),
}

_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
"""Each public name -> the module that defines it (the lazy map)."""

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    """`grpo_lab.<name>`: import its module on first use, then keep it as a plain attribute."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'grpo_lab' has no attribute {name!r} (its public names: "
                             "grpo_lab.__all__, docs/api.md)")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
