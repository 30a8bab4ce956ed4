"""Logprobs without the whole vocabulary's logits: the same numbers and gradients as the plain
computation (grpo_lab.algo.logprobs), sampled logprobs kept as `generate` samples, micro-batches
in the synchronous trainer, float32 master weights under bfloat16 autocast, and the defaults
that fit real data (docs/internals.md, "Real model shapes")."""

import pytest
import torch
from float_tolerance import assert_f32_close, assert_grads_close, f32_atol, logprob_atol
from transformers import LlamaConfig, LlamaForCausalLM

from grpo_lab.algo import logprobs as lp
from grpo_lab.algo.logprobs import completion_logits, policy_logprobs_and_entropy
from grpo_lab.data.datasets import DATASET_MAX_COMPLETION_LENGTH, load_dataset_task
from grpo_lab.model.evaluation import token_batches
from grpo_lab.model.generation import sample_from_ids, sampling_config
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer
from grpo_lab.util.files import write_jsonl


def test_chunks_give_the_whole_log_softmax():
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 50) * 4, torch.randint(0, 50, (3, 5))
    logps = torch.log_softmax(logits / 0.7, -1)
    whole = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logps.exp() * logps).sum(-1)
    for chunk in (1, 4, 7, None):
        got, got_entropy = lp.selective_logprobs(logits, targets, 0.7, entropy=True, chunk=chunk)
        assert torch.equal(got, whole)  # the same operations per position: the same bits
        assert torch.equal(got_entropy, entropy)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def _batch(vocab=300, B=4, P=6, T=9):
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    completion_ids = torch.randint(3, vocab, (B, T), generator=g)
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[1, 5:] = 0  # right padding
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def test_the_split_head_scores_and_differentiates_as_the_full_logits(llama, monkeypatch):
    """Chunked head with recomputation (3 positions a chunk) against logits of every position
    and one log-softmax: values and gradients within float rounding."""
    batch = _batch()
    assert lp.head_split(llama) is not None
    monkeypatch.setattr(lp, "LOGITS_CHUNK_ELEMENTS", 3 * 300)  # 3 positions per chunk
    llama.zero_grad()
    logps, entropy = policy_logprobs_and_entropy(llama, *batch, temperature=0.8)
    (logps * batch[3]).sum().backward()
    split_grads = [p.grad.clone() for p in llama.parameters()]

    llama.zero_grad()
    logits = completion_logits(llama, *batch)  # (B, T, V): the plain way
    plain = torch.log_softmax(logits / 0.8, -1)
    want = plain.gather(-1, batch[2].unsqueeze(-1)).squeeze(-1)
    (want * batch[3]).sum().backward()
    want_entropy = -(plain.exp() * plain).sum(-1)
    # The head's matmul over other rows and the log-softmax: the sums of a logprob.
    assert torch.allclose(logps, want, rtol=0, atol=logprob_atol(want, 300))
    assert torch.allclose(entropy, want_entropy, rtol=0,
                          atol=f32_atol(want.detach().abs().max(), 300))
    for got, expected in zip(split_grads, (p.grad for p in llama.parameters()), strict=True):
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_models_that_do_more_than_a_head_fall_back(llama):
    wrapped = torch.nn.Sequential()  # not a causal LM: no split
    assert lp.head_split(wrapped) is None
    soft_capped = LlamaForCausalLM(llama.config)
    soft_capped.config.model_type = "gemma2"  # soft-caps its logits after the head
    assert lp.head_split(soft_capped) is None


def test_sampled_logprobs_are_the_processed_scores_log_softmax(llama):
    """ChosenLogprobs against `generate(output_scores=True)`: the same draws and the same bits."""

    class Tok:
        eos_token_id, pad_token_id = 2, 0

        def batch_decode(self, ids, skip_special_tokens=True):
            return [" ".join(map(str, r)) for r in ids]

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    torch.manual_seed(3)
    ours = sample_from_ids(llama, Tok(), prompts, max_new_tokens=12, num_generations=1,
                           temperature=0.7)
    width = 4
    ids = torch.tensor([[0] * (width - len(r)) + r for r in prompts])
    mask = (ids != 0).long()
    config = sampling_config(Tok(), 12)
    config.update(temperature=0.7, output_scores=True, return_dict_in_generate=True)
    torch.manual_seed(3)
    out = llama.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    new = out.sequences[:, width:]
    scores = torch.log_softmax(torch.stack(out.scores, 1).float(), -1)
    want = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)
    for row in range(len(prompts)):
        n = len(ours.completion_ids[row])
        assert ours.completion_ids[row] == new[row, :n].tolist()
        assert ours.logprobs[row] == want[row, :n].tolist()


def test_evaluation_batches_fit_the_token_budget():
    lengths = [10, 30, 12, 5, 40, 8]
    batches = token_batches(lengths, max_new_tokens=20, token_budget=100, max_rows=256)
    assert [i for r in batches for i in r] == list(range(6))  # every row once, in order
    for rows in batches:
        width = max(lengths[i] for i in rows) + 20
        assert len(rows) == 1 or len(rows) * width <= 100
    assert len(token_batches(lengths, 20, 10**6, max_rows=4)) == 2  # the row cap


def _trainer(tiny_model_dir, **overrides):
    values = dict(model=str(tiny_model_dir), prompts_per_step=4, num_generations=4, steps=1,
                  eval_size=8, progress=False, log_every=100, seed=0, shared_prompt=False)
    values.update(overrides)
    return GRPOTrainer(GRPOConfig(**values))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_sync_micro_batches_give_one_pass_loss_and_gradient(tiny_model_dir, loss_type):
    """The same sampled batch through one pass and through token_budget micro-batches."""
    plain = _trainer(tiny_model_dir, loss_type=loss_type)
    budgeted = _trainer(tiny_model_dir, loss_type=loss_type, token_budget=40)
    batch, _, _ = plain.make_batch(plain.task.sample_batch(plain.rng, 4))
    grads = []
    for trainer in (plain, budgeted):
        trainer.apply_gradients = lambda t=trainer: grads.append(
            [p.grad.clone() for p in t.model.parameters() if p.requires_grad]) or 0.0
        grads.append(trainer.optimize(batch))
    one_grads, one, split_grads, split = grads
    assert one["batch/microbatches_per_step"] == 1 and split["batch/microbatches_per_step"] > 2
    # The loss sums -A x ratio over the tokens: terms of the advantages' size whose sum is near 0
    # at ratio 1, so it is held to the rounding of its terms, not to its own size.
    tokens = int(batch.completion_mask.sum())
    assert_f32_close(split["loss"], one["loss"], f32_atol(batch.advantages.abs().max(), tokens),
                     "loss")
    assert_grads_close(dict(enumerate(split_grads)), dict(enumerate(one_grads)), terms=tokens)


def test_full_fine_tuning_in_bfloat16_keeps_float32_master_weights(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, use_lora=False, dtype="bfloat16", learning_rate=1e-3)
    assert trainer.autocast_dtype == torch.bfloat16
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.step()
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    # An update of 1e-3 is below bfloat16's resolution at 1.0 (2^-8) but moves float32 weights.
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_dataset_defaults_to_trls_completion_length(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    write_jsonl(rows, tmp_path / "data.jsonl")
    task = load_dataset_task(tmp_path / "data.jsonl", eval_fraction=0.2)
    assert task.max_answer_chars == 2
    assert task.default_max_completion_length == DATASET_MAX_COMPLETION_LENGTH == 256


def test_the_trainer_warns_once_when_completions_hit_the_cap(tiny_model_dir, capsys):
    trainer = _trainer(tiny_model_dir, max_completion_length=1)  # every answer needs more
    trainer.train(steps=2)
    warned = capsys.readouterr().err
    assert warned.count("reached max_completion_length=1") == 1, warned
