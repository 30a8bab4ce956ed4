"""The continuous-batching engine and the sampler, in process, against the trainer's maths."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from grpo_lab.algo.logprobs import policy_logprobs
from grpo_lab.serve.batch import RequestGroup, Sequence, make_generator
from grpo_lab.serve.engine import Engine, generate_sync
from grpo_lab.serve.lora_registry import LoRARegistry, read_adapter
from grpo_lab.serve.sampling import SamplingParams, min_p_filter, sample, top_k_top_p_filter
from grpo_lab.train.rollout_batch import pad_left, pad_right

torch.set_num_threads(1)
PROMPTS = ["12+34=", "7+5=", "99+99=", "1+1=", "50+50="]


def make_engine(model, tokenizer, **kwargs):
    kwargs.setdefault("logprobs_mode", "processed_logprobs")
    return Engine(model, eos_token_ids=[tokenizer.eos_token_id], max_model_len=64, **kwargs)


def seqs_for(tokenizer, prompts, adapter=None, seed0=0, **params):
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    return [Sequence(p, SamplingParams(seed=seed0 + i, **params), adapter,
                     make_generator(seed0 + i)) for i, p in enumerate(ids)]


def trainer_logprobs(model, tokenizer, seqs, temperature):
    """grpo_lab.algo.logprobs.policy_logprobs on the engine's tokens (left/right padded batch)."""
    prompt_ids, prompt_mask = pad_left([s.prompt_ids for s in seqs], tokenizer.pad_token_id)
    completion_ids, mask = pad_right([s.output_ids for s in seqs], tokenizer.pad_token_id)
    served, _ = pad_right([s.logprobs for s in seqs], 0.0)
    with torch.no_grad():
        logps = policy_logprobs(model, prompt_ids, prompt_mask, completion_ids, mask, temperature)
    return logps, served.float(), mask


def wait_for(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def hold_engine_when(model, condition):
    """Hold the engine thread at the start of its first forward after `condition()` holds
    (checked on the engine thread, so it reads the sequences the engine itself writes) until
    the test sets `release`: the test acts at a known step, however fast this machine decodes.
    -> (held, release, hook handle)."""
    held, release = threading.Event(), threading.Event()

    def hold(module, args):
        if not held.is_set() and condition():
            held.set()
            assert release.wait(60), "the test never released the engine"

    return held, release, model.register_forward_pre_hook(hold)


def test_staggered_arrivals_match_the_trainers_logprobs(tiny_model_and_tokenizer, model_copy):
    _, tokenizer = tiny_model_and_tokenizer
    first = seqs_for(tokenizer, PROMPTS, temperature=0.7, max_tokens=40, ignore_eos=True)
    second = seqs_for(tokenizer, PROMPTS[::-1] * 2, seed0=100, temperature=0.7, max_tokens=12)
    # held in the forward of a decode step once `first` has 5 tokens: `second` surely arrives
    # while `first` is mid-decode
    held, release, hook = hold_engine_when(model_copy, lambda: len(first[0].output_ids) >= 5)
    engine = make_engine(model_copy, tokenizer).start()
    try:
        first_done, second_done = threading.Event(), threading.Event()

        class Group(RequestGroup):
            def __init__(self, sequences, done):
                super().__init__(sequences)
                self.done = done

            def resolve(self):
                self.done.set()

        engine.submit(Group(first, first_done))
        assert held.wait(60), "the first batch never reached its 6th step"
        engine.submit(Group(second, second_done))  # arrives while `first` is mid-decode
        assert not any(s.finish_reason for s in first)
        release.set()
        assert first_done.wait(60) and second_done.wait(60)
        # admitted at the next step, between two decode steps of `first`: one batch of all 15
        assert engine.stats["prefills"] == 2
        assert engine.stats["max_batch"] == len(first) + len(second)
        assert all(len(s.output_ids) == 40 and s.finish_reason == "length" for s in first)
        assert all(s.finish_reason in ("stop", "length") for s in second)
        hook.remove()
        logps, served, mask = trainer_logprobs(model_copy, tokenizer, first + second, 0.7)
        assert ((logps - served).abs() * mask).max() < 1e-4
    finally:
        release.set()
        hook.remove()
        engine.stop()


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_model_and_tokenizer, model_copy):
    _, tokenizer = tiny_model_and_tokenizer
    engine = make_engine(model_copy, tokenizer).start()
    try:
        alone = generate_sync(engine, seqs_for(tokenizer, PROMPTS[:1], seed0=7, max_tokens=8))

        def crowd():  # 15 rows around a copy of `alone`
            rows = seqs_for(tokenizer, PROMPTS * 3, seed0=50, max_tokens=8)
            rows[4] = seqs_for(tokenizer, PROMPTS[:1], seed0=7, max_tokens=8)[0]
            return generate_sync(engine, rows)

        first, second = crowd(), crowd()
        assert first[4].output_ids == alone[0].output_ids
        assert [s.output_ids for s in first] == [s.output_ids for s in second]
    finally:
        engine.stop()


def test_one_batch_serves_several_adapters(tiny_model_and_tokenizer, model_copy, make_adapter,
                                           tmp_path):
    """Rows under two adapters and the base, decoded together, each equal PEFT's model."""
    from peft import PeftModel

    base, tokenizer = tiny_model_and_tokenizer
    registry = LoRARegistry(model_copy, max_loras=2, max_lora_rank=8)
    dirs = [make_adapter(tmp_path / f"a{i}", rank=1 + 7 * i, seed=i) for i in range(2)]
    adapters = [read_adapter(f"a{i}", str(d), module_shapes=registry.module_shapes,
                             max_lora_rank=8, dtype=torch.float32) for i, d in enumerate(dirs)]
    for adapter in adapters:
        registry.add(adapter)
    engine = make_engine(model_copy, tokenizer, lora=registry).start()
    try:
        groups = [seqs_for(tokenizer, PROMPTS, adapter=a, seed0=10 * i, temperature=0.7,
                           max_tokens=6) for i, a in enumerate([None, *adapters])]
        mixed = [s for trio in zip(*groups, strict=True) for s in trio]  # interleaved arrival
        generate_sync(engine, mixed)
        assert engine.stats["prefills"] == 1  # all 15 rows in one batch
        for adapter, group in zip([None, *dirs], groups, strict=True):
            reference = (copy.deepcopy(base) if adapter is None
                         else PeftModel.from_pretrained(copy.deepcopy(base), str(adapter)))
            logps, served, mask = trainer_logprobs(reference.eval(), tokenizer, group, 0.7)
            assert ((logps - served).abs() * mask).max() < 1e-4
        assert groups[1][0].logprobs != groups[0][0].logprobs  # the adapter matters
    finally:
        engine.stop()


def test_max_loras_limits_adapters_per_batch(tiny_model_and_tokenizer, model_copy, make_adapter,
                                             tmp_path):
    _, tokenizer = tiny_model_and_tokenizer
    registry = LoRARegistry(model_copy, max_loras=1, max_lora_rank=8)
    for i in range(2):
        registry.add(read_adapter(f"a{i}", str(make_adapter(tmp_path / f"a{i}", seed=i)),
                                  module_shapes=registry.module_shapes, max_lora_rank=8,
                                  dtype=torch.float32))
    seen_segments = []  # the adapters of each forward: the segments the engine set for it
    model_copy.register_forward_pre_hook(
        lambda module, args: seen_segments.append({a.name for a, _, _ in registry.segments}))
    engine = make_engine(model_copy, tokenizer, lora=registry)
    engine.start()
    try:
        seqs = [s for name in ("a0", "a1") for s in
                seqs_for(tokenizer, PROMPTS, adapter=registry.get(name), max_tokens=4)]
        generate_sync(engine, seqs)
        assert all(s.finish_reason for s in seqs)
        assert max(map(len, seen_segments)) == 1 and len(set().union(*seen_segments)) == 2
    finally:
        engine.stop()


@pytest.fixture
def slow_engine(tiny_model_and_tokenizer, model_copy):
    """An engine whose forwards take >= 20 ms, so that a request is surely in flight."""
    _, tokenizer = tiny_model_and_tokenizer
    model_copy.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    engine = make_engine(model_copy, tokenizer)
    yield engine.start(), tokenizer
    engine.stop()


def test_pause_keep_freezes_and_resume_continues(slow_engine, model_copy):
    engine, tokenizer = slow_engine
    running = seqs_for(tokenizer, PROMPTS[:2], max_tokens=40, ignore_eos=True)
    held, release, _ = hold_engine_when(model_copy, lambda: len(running[0].output_ids) >= 2)
    engine.submit(RequestGroup(running))
    assert held.wait(30)
    paused = engine.pause("keep")  # asked for during the step that samples the 3rd token
    release.set()
    paused.result(10)
    frozen = len(running[0].output_ids)
    assert frozen == 3 and running[0].finish_reason is None  # paused mid-decode
    late = seqs_for(tokenizer, PROMPTS[2:3], max_tokens=3)
    engine.submit(RequestGroup(late))  # accepted while paused: waits
    time.sleep(0.3)
    assert len(running[0].output_ids) == frozen and not late[0].output_ids
    engine.resume()
    wait_for(lambda: late[0].finish_reason and running[0].finish_reason)
    assert running[0].finish_reason == "length" and len(running[0].output_ids) == 40


def test_pause_abort_finishes_in_flight_requests_with_abort(slow_engine, model_copy):
    engine, tokenizer = slow_engine
    running = seqs_for(tokenizer, PROMPTS[:2], max_tokens=40, ignore_eos=True)
    held, release, _ = hold_engine_when(model_copy, lambda: len(running[0].output_ids) >= 2)
    engine.submit(RequestGroup(running))
    assert held.wait(30)
    paused = engine.pause("abort")  # asked for during the step that samples the 3rd token
    release.set()
    paused.result(10)
    assert [s.finish_reason for s in running] == ["abort", "abort"]
    assert len(running[0].output_ids) == 3  # aborted after that step: partial output returned
    engine.resume()
    assert generate_sync(engine, seqs_for(tokenizer, PROMPTS[:1], max_tokens=2))[0].finish_reason


def test_pause_wait_lets_in_flight_requests_finish(slow_engine):
    engine, tokenizer = slow_engine
    running = seqs_for(tokenizer, PROMPTS[:2], max_tokens=10, ignore_eos=True)
    engine.submit(RequestGroup(running))
    wait_for(lambda: len(running[0].output_ids) >= 1)
    engine.pause("wait").result(10)
    assert [s.finish_reason for s in running] == ["length", "length"]
    engine.resume()


# ------------------------------------------------------------------------- the sampler


def test_untruncated_processed_logprobs_are_log_softmax_at_temperature():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 0.0)]
    gens = [make_generator(i) for i in range(3)]
    out = sample(logits, params, gens, [None] * 3, "processed_logprobs")
    for row, t in enumerate((0.5, 1.0, 1.0)):  # greedy rows report T = 1 logprobs
        expected = torch.log_softmax(logits[row] / t, -1)[out.tokens[row]]
        assert torch.isclose(out.logprobs[row], expected)
    assert out.tokens[2] == logits[2].argmax()
    raw = sample(logits, params, [make_generator(i) for i in range(3)], [None] * 3,
                 "raw_logprobs")
    assert torch.equal(raw.tokens, out.tokens)  # same generators, same draws
    assert torch.allclose(raw.logprobs, torch.log_softmax(logits, -1).gather(
        1, raw.tokens.unsqueeze(1)).squeeze(1))


def test_truncation_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = top_k_top_p_filter(logits, torch.tensor([2]), None)
    assert torch.isinf(kept[0, 2:]).all() and torch.equal(kept[0, :2], logits[0, :2])
    probs = torch.softmax(logits, -1)[0]  # 0.64, 0.24, 0.09, ...
    kept = top_k_top_p_filter(logits, None, torch.tensor([0.8]))  # needs the top two
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    kept = min_p_filter(logits, torch.tensor([[0.3]]))  # keeps p >= 0.3 * 0.64
    assert torch.isfinite(kept[0]).tolist() == (probs >= 0.3 * probs[0]).tolist()
    # Sampled tokens never leave the top-k set, and their logprob is renormalised.
    params = [SamplingParams(top_k=2)]
    for seed in range(20):
        out = sample(logits, params, [make_generator(seed)], [None], "processed_logprobs")
        assert out.tokens[0] in (0, 1)
        assert torch.isclose(out.logprobs[0], torch.log_softmax(logits[0, :2], -1)[out.tokens[0]])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    seen = torch.tensor([True, True, False])
    out = sample(logits, [SamplingParams(repetition_penalty=2.0, temperature=0)],
                 [make_generator(0)], [seen], "processed_logprobs")
    expected = torch.log_softmax(torch.tensor([1.0, -4.0, 1.0]), -1)
    assert torch.isclose(out.logprobs[0], expected[out.tokens[0]])
