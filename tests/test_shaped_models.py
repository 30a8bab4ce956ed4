"""Random-weight models at real shapes: the vocab-only shape built, loaded, padded, templated."""

import json
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer

from grpo_lab.data.prompts import encode_prompts
from grpo_lab.model.chat_model import CHAT_TEMPLATE, ENDOFTEXT, IM_END, SYSTEM_PROMPT
from grpo_lab.model.memory_model import num_parameters
from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.model.shaped_models import (
    QWEN25_05B,
    QWEN25_MATH_15B,
    VOCAB_ONLY,
    build_info,
    build_shaped_model,
    dataset_files,
    qwen2_config,
    random_model,
    shape_key,
    shaped_model_path,
)
from grpo_lab.util.files import read_jsonl

SPECIAL_IDS = SimpleNamespace(eos_token_id=2, pad_token_id=0)  # ChatML ids of the chat tokenizer


@pytest.fixture(scope="module")
def vocab_only(tmp_path_factory):
    """The vocab-only shape built into a fresh folder (about a second)."""
    folder = tmp_path_factory.mktemp("vocab-only")
    return folder, build_shaped_model(VOCAB_ONLY, folder, seed=0)


def test_published_shapes():
    for shape in (QWEN25_05B, QWEN25_MATH_15B):
        assert (shape.vocab_size, shape.tokenizer_size, shape.tie_word_embeddings) == (
            151_936, 151_665, True)
    assert (QWEN25_05B.head_dim, QWEN25_MATH_15B.head_dim) == (64, 128)
    assert (QWEN25_05B.rope_theta, QWEN25_MATH_15B.rope_theta) == (1e6, 1e4)
    assert QWEN25_MATH_15B.max_position_embeddings == 4096


def test_built_folder_loads_with_the_padded_vocabulary(vocab_only):
    folder, info = vocab_only
    model, tokenizer = load_model_and_tokenizer(folder)
    assert len(tokenizer) == VOCAB_ONLY.tokenizer_size == 151_665
    assert model.config.vocab_size == model.get_input_embeddings().weight.shape[0] == 151_936
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    assert model.config.rope_parameters["rope_theta"] == VOCAB_ONLY.rope_theta
    n = sum(p.numel() for p in model.parameters())
    assert n == info["num_parameters"] == num_parameters(VOCAB_ONLY)
    assert (folder / "model.safetensors").exists()
    assert build_info(folder)["build_seconds"] == info["build_seconds"]


def test_chat_template_and_specials(vocab_only):
    folder, _ = vocab_only
    _, tokenizer = load_model_and_tokenizer(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == (
        IM_END, ENDOFTEXT, "left")
    ids = encode_prompts(tokenizer, ["Sam has 3 pens."])[0]
    text = tokenizer.decode(ids)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n") and "Sam has 3 pens." in text


def test_fillers_decode_and_leave_encoding_alone(vocab_only):
    folder, _ = vocab_only
    _, tokenizer = load_model_and_tokenizer(folder)
    text = "Zoe has 12 shells and buys 7 more.\n#### 19"
    ids = tokenizer(text)["input_ids"]
    assert max(ids) < 512 and tokenizer.decode(ids) == text  # the trained BPE encodes, as before
    filler = tokenizer.decode([151_000])
    assert filler.startswith(" ") and filler[1:].isalpha()  # a word, as a real vocabulary's
    assert tokenizer.decode([151_700]) == ""  # the model's padding rows decode to nothing
    core = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert core.get_vocab_size() == 151_665


def test_word_problems_beside_the_model(vocab_only):
    folder, _ = vocab_only
    files = dataset_files(folder)
    train, test = read_jsonl(files["train"]), read_jsonl(files["test"])
    assert len(train) == 256 and len(test) == 64
    assert set(train[0]) == {"question", "answer"} and "####" in train[0]["answer"]
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_random_weights_are_seeded_and_sized():
    config = qwen2_config(VOCAB_ONLY, SPECIAL_IDS)
    a, b, c = (random_model(config, seed) for seed in (0, 0, 1))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("proj.weight"):
            assert not torch.equal(pa, pc) and abs(pa.std().item() - 0.02) < 0.002, name
        if name.endswith("norm.weight"):
            assert torch.all(pa == 1), name
    assert torch.all(a.get_input_embeddings().weight[0] == 0)  # the padding row
    inv_freq = a.model.rotary_emb.inv_freq
    assert torch.isfinite(inv_freq).all() and inv_freq[0] == 1.0
    bf16 = random_model(config, 0, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16


def test_cache_is_keyed_by_shape_seed_and_dtype():
    keys = {shape_key(VOCAB_ONLY, 0), shape_key(VOCAB_ONLY, 1),
            shape_key(VOCAB_ONLY, 0, "bfloat16"), shape_key(QWEN25_05B, 0)}
    assert len(keys) == 4
    first = shaped_model_path("vocab-only")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert shaped_model_path(VOCAB_ONLY) == first  # found, not rebuilt
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert json.loads((first / "grpo_lab_recipe.json").read_text())["seed"] == 0


def test_one_grpo_step_at_the_real_vocabulary(vocab_only):
    """grpo_lab's trainer on a 151,936-row vocabulary, every completion run to its cap."""
    from grpo_lab.train.config import GRPOConfig
    from grpo_lab.train.trainer import GRPOTrainer

    folder, _ = vocab_only
    files = dataset_files(folder)
    config = GRPOConfig(model=str(folder), dataset=str(files["train"]),
                        eval_split=str(files["test"]), reward="math_answer", prompts_per_step=1,
                        num_generations=2, max_completion_length=4, steps=1, eval_every=0,
                        progress=False, log_completions_every=0, device="cpu", dtype="float32")
    model, tokenizer = load_model_and_tokenizer(folder)
    model.generation_config.min_new_tokens = 4  # as benchmarks/real_shapes.py does
    record = GRPOTrainer(config, model=model, tokenizer=tokenizer).step()
    assert record["completions/mean_length"] == 4
    assert torch.isfinite(torch.tensor(record["loss"]))
