"""The run doctor (grpo_lab.watch.doctor): short runs broken on purpose each raise their finding,
healthy runs raise none; `grpo-lab doctor RUN_DIR` and the TRL callback say the same."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from grpo_lab.cli.doctor import diagnose_run
from grpo_lab.cli.main import main as cli
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer
from grpo_lab.watch.doctor import Doctor, chat_template_finding, pipeline_doctor


def _run(tmp_path=None, **settings):
    config = GRPOConfig(eval_every=0, log_every=1000, progress=False, eval_size=16,
                        output_dir=str(tmp_path) if tmp_path else None, **settings)
    trainer = GRPOTrainer(config)
    trainer.train()
    return trainer, [f.code for f in trainer.logger.findings]


# -- runs broken on purpose: each raises its finding, once ------------------------------------

def test_a_length_cap_of_one_token_is_named_once_with_its_evidence(tmp_path, tiny_model_dir,
                                                                   capsys):
    trainer, codes = _run(tmp_path, steps=12, max_completion_length=1)
    assert "completions_cut" in codes and codes.count("completions_cut") == 1
    finding = next(f for f in trainer.logger.findings if f.code == "completions_cut")
    assert finding.evidence["metric"] == "completions/clipped_ratio"
    assert finding.evidence["value"] == 1.0 and finding.step == 10
    assert capsys.readouterr().out.count("completions are cut at the length cap") == 1
    written = [json.loads(line) for line in (tmp_path / "findings.jsonl").read_text().splitlines()]
    assert [f["code"] for f in written] == codes


def test_a_near_greedy_temperature_leaves_no_learning_signal(tiny_model_dir):
    trainer, codes = _run(steps=12, temperature=1e-3)  # every group's completions are the same
    assert codes == ["no_learning_signal"]  # (its entropy, ~0, doubles in noise: not a finding)
    cause = trainer.logger.findings[0].cause
    assert "at temperature 0.001" in cause and "nearly the same" in cause, cause


def test_a_constant_reward_is_named_as_the_cause(tiny_model_dir):
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    trainer, codes = _run(steps=12, reward=always_one)
    assert codes == ["no_learning_signal"]
    cause = trainer.logger.findings[0].cause
    assert "every completion gets the same reward (1)" in cause, cause


def test_a_vanishing_learning_rate_is_named_early_by_what_did_not_move(tiny_model_dir):
    trainer, codes = _run(steps=12, learning_rate=1e-9)
    assert codes == ["policy_not_moving"]
    finding = trainer.logger.findings[0]
    assert finding.step == 10  # as soon as a window is in
    assert "learning_rate=1e-09 is too small to move the weights" in finding.cause


def test_a_flat_reward_names_a_learning_rate_too_small():
    records = [{"step": s, "reward": 0.3 + 0.01 * (s % 2), "entropy": 0.5 - 0.02 * (s % 3),
                "grad_norm": 0.1} for s in range(1, 86)]
    found = Doctor(learning_rate=3e-7).read(records)
    flat = next(f for f in found if f.code == "reward_flat")
    assert "learning_rate=3e-07 is too small to move the weights" in flat.cause
    assert "while the policy moves" not in flat.title


def test_a_learning_rate_too_high_is_named(tiny_model_dir):
    # full fine-tuning at 1e-2: entropy explodes within steps (and every completion is cut)
    _, codes = _run(steps=12, use_lora=False, learning_rate=1e-2)
    assert "entropy_exploded" in codes, codes
    # two updates per batch at 1e-3: the second one clips a third of the tokens
    _, codes = _run(steps=3, use_lora=False, learning_rate=1e-3, num_iterations=2)
    assert "learning_rate_too_high" in codes, codes


def test_a_chat_model_fed_plain_text_is_named_before_the_first_step(chat_model_dir):
    data = chat_model_dir / "data"
    settings = dict(model=str(chat_model_dir), dataset=str(data / "train.jsonl"),
                    eval_split=str(data / "test.jsonl"), steps=1, eval_size=4)
    config = GRPOConfig(chat_template=False, **settings)
    trainer = GRPOTrainer(config)
    trainer.check_prompt_format()
    assert [f.code for f in trainer.logger.findings] == ["chat_template_skipped"]
    templated = GRPOTrainer(GRPOConfig(**settings))
    templated.check_prompt_format()
    assert templated.logger.findings == []


def test_a_buffer_four_steps_deep_pins_the_staleness_at_its_bound(tiny_model_dir):
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer

    config = AsyncGRPOConfig(steps=16, max_staleness=3, buffer_size=64, eval_every=0,
                             log_every=1000, progress=False, eval_size=16,
                             log_completions_every=0)
    trainer = AsyncGRPOTrainer(config)
    # A trainer slower than generation, on any machine: each step first waits until the buffer
    # holds every batch that admission lets the worker make (the trained one and 3 ahead). Left
    # to the two threads' speeds, the worker fell behind now and then on CI's processor, and a
    # step at staleness 2 inside the doctor's 10-step window is, rightly, not pinned.
    take = trainer.next_groups
    ahead = (config.max_staleness + 1) * config.prompts_per_step

    def after_the_worker_ran_ahead(start):
        deadline = time.monotonic() + 120
        while len(trainer.buffer) < ahead and trainer.worker_alive:
            assert time.monotonic() < deadline, "the rollout worker never filled the buffer"
            time.sleep(0.01)
        return take(start)

    trainer.next_groups = after_the_worker_ran_ahead
    trainer.train()
    staleness = [r["sample/staleness_mean"] for r in trainer.logger.records[1:]]
    assert staleness == [0, 1, 2] + [3] * 13
    assert [f.code for f in trainer.logger.findings] == ["staleness_pinned"]


def test_a_replica_that_never_loads_the_adapter_serves_samples_not_from_the_policy(
        tiny_model_dir):
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer
    from grpo_lab_course.tails_trainer import FrozenReplica

    trainer = AsyncGRPOTrainer(AsyncGRPOConfig(steps=40, eval_every=0, log_every=1000,
                                               progress=False, eval_size=16,
                                               log_completions_every=0))
    trainer.generator = FrozenReplica(trainer.model, trainer.tokenizer)
    trainer.train()
    codes = [f.code for f in trainer.logger.findings]
    assert "not_from_policy" in codes, codes


# -- healthy runs raise nothing ------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_a_healthy_run_raises_no_finding(tiny_model_dir, seed):
    _, codes = _run(steps=100, seed=seed)  # the demo's LoRA settings, 100 steps
    assert codes == []


# -- the asynchronous findings, from their records ---------------------------------------------

def _async_records(kls, staleness=0.5, dropped_every_step=False):
    return [{"step": i + 1, "version": i + 1, "kl": kl, "reward": 0.3, "grad_norm": 1.0,
             "sample/staleness_mean": staleness,
             "sample/dropped_stale_total": (i + 1) * 2 if dropped_every_step else 0}
            for i, kl in enumerate(kls)]


def test_samples_that_drift_from_a_publishing_trainer_are_not_from_its_policy():
    drifting = _async_records([1e-3 * (1.06 ** i) for i in range(40)])  # 1e-3 -> 1e-2
    codes = [f.code for f in Doctor(max_staleness=1).read(drifting)]
    assert codes == ["not_from_policy"]
    decaying = _async_records([2.2e-3 * (0.95 ** i) for i in range(40)])  # the demo's, lr decay
    assert Doctor(max_staleness=1).read(decaying) == []
    steady = _async_records([1e-4] * 30)
    assert Doctor(max_staleness=1).read(steady) == []


# Notebook 04's synchronous run at seed 1, one thread (a healthy run: greedy accuracy 0.29 ->
# 0.49): its sampled reward per step, measured. A 10-step window of it sits within 0.03 of the
# first window near step 80, which alone reads as flat.
SEED_1_REWARDS = [
    0.125, 0.1641, 0.2266, 0.2109, 0.1641, 0.2266, 0.2344, 0.1094, 0.25, 0.2344, 0.2656, 0.2422,
    0.1172, 0.2578, 0.2031, 0.2031, 0.1406, 0.25, 0.2344, 0.2188, 0.2969, 0.1875, 0.2109, 0.2031,
    0.1641, 0.2188, 0.2188, 0.1953, 0.2344, 0.2031, 0.1328, 0.2031, 0.2188, 0.2188, 0.1875, 0.3281,
    0.2344, 0.2812, 0.25, 0.3047, 0.2188, 0.4062, 0.2578, 0.25, 0.2578, 0.2422, 0.3359, 0.2188,
    0.2969, 0.2344, 0.2188, 0.2656, 0.2578, 0.2422, 0.3047, 0.1875, 0.2578, 0.2109, 0.1875, 0.1641,
    0.1406, 0.2188, 0.1875, 0.1719, 0.3047, 0.25, 0.1953, 0.2266, 0.2656, 0.1797, 0.2031, 0.2266,
    0.2422, 0.2422, 0.2344, 0.1953, 0.3203, 0.2734, 0.2109, 0.2734, 0.3984, 0.1719, 0.2422, 0.25,
    0.2188, 0.1328, 0.2578, 0.2109, 0.2344, 0.1875, 0.3281, 0.3125, 0.2969, 0.2344, 0.2812, 0.2656,
    0.2578, 0.2734, 0.2969, 0.2109, 0.2266, 0.3047, 0.2812, 0.2656, 0.2734, 0.3203, 0.2422, 0.25,
    0.2344, 0.2734, 0.3047, 0.2422, 0.2891, 0.3047, 0.2812, 0.1953, 0.2422, 0.2344, 0.2656, 0.2734,
    0.3359, 0.2812, 0.1719, 0.2578, 0.2422, 0.2266, 0.2266, 0.2969, 0.2344, 0.2422, 0.2422, 0.25,
    0.3516, 0.2812, 0.2578, 0.2422, 0.3594, 0.2969, 0.3203, 0.3359, 0.2812, 0.2578, 0.3281, 0.3906,
    0.3516, 0.2344, 0.2578, 0.1875, 0.3281, 0.3203,
]
SEED_1_ACCURACY = [(0, 0.293), (25, 0.414), (50, 0.473), (75, 0.480), (100, 0.471), (125, 0.459),
                   (150, 0.488)]


def _sync_records(rewards, accuracy):
    evaluated = dict(accuracy)
    records = [{"step": 0, "eval/accuracy": evaluated[0]}]
    for step, reward in enumerate(rewards, start=1):
        record = {"step": step, "reward": reward, "grad_norm": 0.1}
        if step in evaluated:
            record["eval/accuracy"] = evaluated[step]
        records.append(record)
    return records


def test_a_reward_that_rises_slowly_while_held_out_accuracy_rises_is_not_flat():
    no_evaluation = [r for r in _sync_records(SEED_1_REWARDS, SEED_1_ACCURACY)
                     if "reward" in r]
    for r in no_evaluation:
        r.pop("eval/accuracy", None)
    assert [f.code for f in Doctor().read(no_evaluation)] == ["reward_flat"]  # the reward alone
    assert Doctor().read(_sync_records(SEED_1_REWARDS, SEED_1_ACCURACY)) == []
    # a run whose accuracy stays within 0.05 of its start is still flat
    stuck = [(step, 0.293 + 0.01 * (step > 0)) for step, _ in SEED_1_ACCURACY]
    flat = Doctor().read(_sync_records(SEED_1_REWARDS, stuck))
    assert [f.code for f in flat] == ["reward_flat"]
    assert flat[0].evidence["eval_accuracy"] == [0.293, 0.303]


REAL_MODEL_ENTROPY = [0.418, 0.222, 0.198, 0.203, 0.079, 0.085, 0.078, 0.06, 0.068, 0.112, 0.1,
                      0.084, 0.056, 0.079, 0.038, 0.067, 0.031, 0.071, 0.053, 0.031]
REAL_MODEL_REWARD = [0.203, 0.562, 0.578, 0.578, 0.641, 0.578, 0.688, 0.594, 0.625, 0.609,
                     0.484, 0.453, 0.719, 0.5, 0.844, 0.625, 0.859, 0.547, 0.578, 0.703]
"""Notebook 09b's run (SmolLM2-135M-Instruct, sum_form, seed 0): held-out 43.4 -> 62.1 %."""


def _entropy_records(entropy, reward):
    return [{"step": step, "entropy": e, "reward": r, "grad_norm": 0.1}
            for step, (e, r) in enumerate(zip(entropy, reward), start=1)]


def test_entropy_that_collapses_while_the_reward_rises_is_convergence_not_a_finding():
    """A real model settling on the one right reply: entropy to 0.1x of its start while the
    reward rises. The same entropy with the reward flat or falling is a collapse."""
    assert Doctor().read(_entropy_records(REAL_MODEL_ENTROPY, REAL_MODEL_REWARD)) == []
    flat = [0.58] * 10 + [0.56] * 10  # twice the learning rate: 0.58 -> 0.54 (real_model_gain.json)
    found = Doctor().read(_entropy_records(REAL_MODEL_ENTROPY, flat))
    assert [f.code for f in found] == ["entropy_collapsed"]
    assert found[0].evidence["value"] < found[0].evidence["threshold"]


def test_a_correction_raises_the_bound_on_the_sampler_mismatch():
    records = _async_records([1.5e-2] * 12)
    assert [f.code for f in Doctor(max_staleness=1).read(records)] == ["sampler_mismatch"]
    assert Doctor(correction="tis", max_staleness=1).read(records) == []


def test_staleness_pinned_at_its_bound_or_drops_every_step():
    pinned = Doctor(max_staleness=2).read(_async_records([1e-4] * 12, staleness=2.0))
    assert [f.code for f in pinned] == ["staleness_pinned"]
    dropping = Doctor(max_staleness=2).read(_async_records([1e-4] * 12, dropped_every_step=True))
    assert [f.code for f in dropping] == ["staleness_pinned"]
    on_policy = Doctor(max_staleness=0).read(_async_records([1e-4] * 12, staleness=0.0))
    one_ahead = Doctor(max_staleness=1).read(_async_records([1e-4] * 12, staleness=1.0))
    assert on_policy == [] and one_ahead == []  # generation one version ahead: the design


def test_the_pipeline_doctor_names_a_slow_trainer():
    full_queue = [{"step": i, "sample/rollout_queue_size": 8, "sample/rollout_queue_maxsize": 8,
                   "perf/step_s": 1.0, "perf/rollout_wait_s": 0.0,
                   "rollout/backpressure_total_s": 0.6} for i in range(1, 25)]
    codes = [f.code for f in pipeline_doctor().read(full_queue)]
    assert codes == ["bottleneck_trainer"]
    assert [f.code for f in Doctor().read(full_queue)] == []  # the trainers' own doctor: no
    # pipeline reading without the queue's numbers in context


def test_the_chat_template_check_reads_the_template(chat_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    plain = "Tom has 3 apples."
    assert chat_template_finding(tokenizer, plain).code == "chat_template_skipped"
    templated = tokenizer.apply_chat_template([{"role": "user", "content": plain}],
                                              tokenize=False, add_generation_prompt=True)
    assert chat_template_finding(tokenizer, templated) is None


# -- grpo-lab doctor RUN_DIR -------------------------------------------------------------------

class _Replica(BaseHTTPRequestHandler):
    served = ["tiny"]

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"data": [{"id": name} for name in self.served]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_grpo_lab_doctor_reads_a_run_folder_and_asks_the_replicas(tmp_path, tiny_model_dir,
                                                                  capsys):
    _run(tmp_path, steps=12)
    assert cli(["doctor", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().endswith("no findings")
    # the trainer published policy-v3, but the replica serves the base model only
    (tmp_path / "syncs.jsonl").write_text(json.dumps({"version": 3, "sync_s": 0.1}) + "\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        findings = diagnose_run(tmp_path, server_url=url)
        assert [f.code for f in findings] == ["adapter_not_loaded"]
        assert findings[0].evidence == {"replica": url, "expected": "policy-v3", "served": "tiny"}
        assert cli(["doctor", str(tmp_path), "--server-url", url]) == 1
        assert "a replica does not serve the trainer's adapter" in capsys.readouterr().out
        _Replica.served = ["tiny", "policy-v3"]
        assert diagnose_run(tmp_path, server_url=url) == []
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_grpo_lab_doctor_takes_the_key_from_a_file_or_the_environment_never_argv(
        tmp_path, monkeypatch):
    import argparse

    from grpo_lab.cli.doctor import api_key

    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    monkeypatch.setenv("VLLM_API_KEY", "sk-from-env")
    ask = argparse.Namespace(api_key=None, api_key_file=None)
    assert api_key(ask) == "sk-from-env"
    assert api_key(argparse.Namespace(api_key=None, api_key_file=key_file)) == "sk-from-file"
    with pytest.raises(SystemExit, match="process list: set VLLM_API_KEY"):
        cli(["doctor", str(tmp_path), "--api-key", "sk-in-argv"])
    with pytest.raises(SystemExit, match="cannot read --api-key-file"):
        api_key(argparse.Namespace(api_key=None, api_key_file=tmp_path / "missing"))


def test_grpo_lab_doctor_refuses_a_folder_without_metrics(tmp_path, capsys):
    assert cli(["doctor", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


# -- TRL's GRPOTrainer, with the doctor as a callback ------------------------------------------

def test_the_callback_names_a_broken_trl_run(tmp_path, tiny_model_dir):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig as TrlConfig
    from trl import GRPOTrainer as TrlTrainer

    from grpo_lab.trl.doctor_callback import DoctorCallback

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    prompts = Dataset.from_dict({"prompt": [f"{a:02d}+{b:02d}=" for a in range(10, 22)
                                            for b in range(10, 12)]})
    args = TrlConfig(output_dir=str(tmp_path), per_device_train_batch_size=8,
                     num_generations=4, max_completion_length=1, max_steps=12, logging_steps=1,
                     learning_rate=1e-5, report_to=[], use_cpu=True, disable_tqdm=True,
                     save_strategy="no", seed=0)
    callback = DoctorCallback()
    def no_reward(completions, **kwargs):  # every group's rewards equal: no signal, on purpose
        return [0.0] * len(completions)

    trainer = TrlTrainer(model=model, reward_funcs=no_reward, args=args, train_dataset=prompts,
                         processing_class=tokenizer, callbacks=[callback])
    trainer.train()
    codes = [f.code for f in callback.findings]
    assert "completions_cut" in codes and "no_learning_signal" in codes, codes


def test_a_healthy_thirty_step_real_model_run_raises_no_finding():
    """benchmarks/real_model_gain.py, seed 1 (SmolLM2-135M-Instruct, sum_form, 30 steps, lr 5e-4,
    43.4 % -> 67.6 % held out): its logged reward, entropy and zero-spread share, step by step.
    The entropy falls to 0.01-0.1 nats while the reward rises: convergence, not a finding."""
    run = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results"
                      / "real_model_gain.json").read_text())["runs"]["native-2t/seed-1"]
    records = [{"step": step, "reward": r, "entropy": e, "frac_reward_zero_std": z,
                "grad_norm": 0.1} for step, (r, e, z) in enumerate(
                    zip(run["reward_by_step"], run["entropy_by_step"], run["zero_std_by_step"]),
                    start=1)]
    assert len(records) == 30
    assert Doctor(learning_rate=5e-4, temperature=1.0).read(records) == []


def test_the_doctor_callback_names_untemplated_prompts_to_a_chat_model(tmp_path, chat_model_dir):
    """Inside TRL's trainer: string prompts to a model with a chat template go untemplated (TRL
    templates conversational prompts only), named before the first step; conversational
    prompts raise nothing."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig as TrlConfig
    from trl import GRPOTrainer as TrlTrainer

    from grpo_lab.trl.doctor_callback import DoctorCallback

    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir, padding_side="left")
    args = TrlConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                     max_completion_length=2, max_steps=1, report_to=[], use_cpu=True,
                     disable_tqdm=True, save_strategy="no", seed=0)
    questions = [f"What is {a} + 7?" for a in range(8)]
    found = {}
    for form, prompts in (("plain", questions),
                          ("chat", [[{"role": "user", "content": q}] for q in questions])):
        callback = DoctorCallback(write=lambda text: None)
        TrlTrainer(model=AutoModelForCausalLM.from_pretrained(chat_model_dir),
                   reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                   train_dataset=Dataset.from_dict({"prompt": prompts}),
                   processing_class=tokenizer, callbacks=[callback]).train()
        found[form] = [f.code for f in callback.findings]
        # TRL's temperature reached the doctor (its causes name it); no LoRA: no learning rate
        assert (callback.doctor.temperature, callback.doctor.learning_rate) == (1.0, None)
    assert "chat_template_skipped" in found["plain"], found
    assert "chat_template_skipped" not in found["chat"], found
