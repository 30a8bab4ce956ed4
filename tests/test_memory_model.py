"""The memory model of a GRPO step: parameter counts, the activation formula against autograd,
and how each term moves with the setting."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_lab.model.memory_model import (
    StepSetting,
    layer_activation_bytes,
    lora_parameters,
    num_parameters,
    step_memory,
)
from grpo_lab.model.shaped_models import QWEN25_05B, QWEN25_MATH_15B, VOCAB_ONLY, qwen2_config

SMALL = SimpleNamespace(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True)
"""A small Qwen2 whose saved tensors autograd can count in a blink."""
# peft 0.21 reads transformers' deprecated `is_gradient_checkpointing` (grpo_lab.train.trainer)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")


def small_model(layers: int, dtype: torch.dtype, lora_rank: int | None):
    config = Qwen2Config(num_hidden_layers=layers, **vars(SMALL))
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(dtype)
    if lora_rank:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_rank, target_modules="all-linear",
                                                 lora_dropout=0.0)).base_model.model
    return model.train()


def saved_bytes(model, rows: int, tokens: int) -> int:
    """Bytes of the tensors autograd keeps for the decoder's backward, parameters aside, each
    storage counted once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, SMALL.vocab_size, (rows, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids).last_hidden_state.sum().backward()
    return sum(seen.values())


def test_parameter_counts_of_the_published_models():
    assert num_parameters(QWEN25_05B) == 494_032_768  # Qwen2.5-0.5B, tied embeddings
    assert abs(num_parameters(QWEN25_05B) / 494e6 - 1) < 0.01
    assert num_parameters(QWEN25_MATH_15B) == 1_543_714_304  # "1.54B"
    untied = replace(QWEN25_05B, tie_word_embeddings=False)
    assert num_parameters(untied) - num_parameters(QWEN25_05B) == 151_936 * 896


def test_parameter_counts_match_real_modules():
    ids = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    with torch.device("meta"):  # shapes only
        model = Qwen2ForCausalLM(qwen2_config(VOCAB_ONLY, ids))
    assert num_parameters(VOCAB_ONLY) == sum(p.numel() for p in model.parameters())
    lora = small_model(2, torch.float32, lora_rank=3)
    trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert lora_parameters(SimpleNamespace(num_hidden_layers=2, **vars(SMALL)), 3) == trained


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lora_rank", [None, 2])
def test_activation_formula_is_what_autograd_keeps(dtype, lora_rank):
    """Per layer and token: the difference between a 3-layer and a 1-layer model's saved bytes,
    over 2 layers and every token, is the formula's, exactly."""
    rows, tokens = 2, 24
    measured = [saved_bytes(small_model(n, getattr(torch, dtype), lora_rank), rows, tokens)
                for n in (1, 3)]
    per_layer_token = (measured[1] - measured[0]) / (2 * rows * tokens)
    assert per_layer_token == layer_activation_bytes(SMALL, dtype, lora_rank)


def test_terms_move_with_the_setting():
    base = StepSetting(prompts=2, num_generations=8, prompt_tokens=48, completion_tokens=128,
                       lora_rank=1)
    m = step_memory(QWEN25_05B, base)
    assert m.total == m.persistent + max(m.training, m.generation)
    totals = [step_memory(QWEN25_05B, replace(base, prompts=p)).total for p in (1, 2, 4, 8)]
    assert totals == sorted(totals) and len(set(totals)) == 4  # grows with the batch
    longer = step_memory(QWEN25_05B, replace(base, completion_tokens=256))
    assert longer.activations > m.activations and longer.kv_cache > m.kv_cache
    full = step_memory(QWEN25_05B, replace(base, lora_rank=None))
    assert m.total < full.total and m.trainable_parameters < full.trainable_parameters
    assert full.optimizer == 8 * 494_032_768 and full.gradients == 4 * 494_032_768
    checkpointed = step_memory(QWEN25_05B, replace(base, activation_checkpointing=True))
    assert checkpointed.activations < m.activations / 5
    chunked = step_memory(QWEN25_05B, replace(base, logits_chunk_rows=441))
    assert chunked.logits == 441 * 151_936 * 16  # float32: the head's output + 3 copies
    assert chunked.logits < m.logits / 4  # 441 positions of 2 x 8 x 128
    micro = step_memory(QWEN25_05B, replace(base, micro_batch_rows=4))
    assert micro.activations < m.activations and micro.gradients == m.gradients


def test_bfloat16_with_master_weights_is_zeros_16_bytes():
    setting = StepSetting(dtype="bfloat16")
    full = step_memory(QWEN25_MATH_15B, setting)
    n = 1_543_714_304
    assert (full.weights, full.master_weights, full.gradients, full.optimizer) == (
        2 * n, 4 * n, 2 * n, 8 * n)
    lora = step_memory(QWEN25_MATH_15B, replace(setting, lora_rank=1))
    assert lora.master_weights == 0  # the adapters are float32 already
    assert lora.weights == 2 * n + 4 * lora.trainable_parameters
    remote = step_memory(QWEN25_MATH_15B, replace(setting, generate_in_process=False))
    assert remote.kv_cache == remote.generation_logits == 0


def test_kv_cache_formula_and_table():
    setting = StepSetting(prompts=4, num_generations=8, prompt_tokens=100, completion_tokens=900)
    m = step_memory(QWEN25_MATH_15B, setting, label="blog-ish")
    # layers x (K and V) x KV heads x head_dim x bytes, per token, for 32 rows of 1,000 tokens
    assert m.kv_cache == 28 * 2 * 2 * 128 * 4 * 32 * 1000
    text = str(m)
    assert text.startswith("blog-ish: 1,543,714,304 parameters")
    for term in ("weights", "optimizer", "activations", "logits", "KV cache", "total", "GiB"):
        assert term in text
    hf = step_memory(Qwen2Config(**{k: getattr(QWEN25_MATH_15B, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size", "tie_word_embeddings")}), setting)
    assert hf.total == m.total  # a transformers config reads the same
