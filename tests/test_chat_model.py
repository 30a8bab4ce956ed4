"""The offline chat model and its word problems: GSM8K format, BPE + ChatML, a Qwen2 with skill."""

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_lab.data.prompts import encode_prompts
from grpo_lab.data.rewards import math_answer_reward
from grpo_lab.data.tasks import word_problems, write_word_problems
from grpo_lab.model.chat_model import (
    DATA_FOLDER,
    SYSTEM_PROMPT,
    ChatModelRecipe,
    as_problems,
    build_bpe_tokenizer,
)
from grpo_lab.model.evaluation import greedy_accuracy
from grpo_lab.util.files import read_jsonl


def _corpus():
    return [text for row in word_problems(300, seed=5) for text in row.values()]


def test_word_problems_are_gsm8k_rows_and_deterministic(tmp_path):
    rows = word_problems(200, seed=3)
    assert rows == word_problems(200, seed=3) and rows != word_problems(200, seed=4)
    assert len({row["question"] for row in rows}) == 200
    for row in rows:
        assert set(row) == {"question", "answer"}
        equation, final = row["answer"].split("\n")
        assert final == f"#### {equation.split(' = ')[1]}"
    answers = [row["answer"] for row in rows]
    assert math_answer_reward(answers, answer=answers) == [1.0] * len(rows)
    first = write_word_problems(tmp_path / "a", train_size=300, test_size=100, seed=7)
    second = write_word_problems(tmp_path / "b", train_size=300, test_size=100, seed=7)
    for split in ("train", "test"):
        assert first[split].read_bytes() == second[split].read_bytes()


def test_train_and_test_questions_are_disjoint(tmp_path):
    paths = write_word_problems(tmp_path, train_size=1000, test_size=300, seed=0)
    train, test = (read_jsonl(paths[split]) for split in ("train", "test"))
    assert (len(train), len(test)) == (1000, 300)
    assert not {r["question"] for r in train} & {r["question"] for r in test}


def test_bpe_tokenizer_round_trips_and_splits_digits(tmp_path):
    tok = build_bpe_tokenizer(_corpus(), vocab_size=512)
    assert 300 < len(tok) <= 512
    text = "Zoe has 128 shells and buys 7 more.\n#### 135 (and some unseen text: été!)"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: any text round-trips
    digits = [t for t in tok.convert_ids_to_tokens(tok("x 2025 y")["input_ids"]) if t.isdigit()]
    assert digits == ["2", "0", "2", "5"]
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == tok.chat_template
    assert (loaded.eos_token, loaded.pad_token, loaded.padding_side) == (
        "<|im_end|>", "<|endoftext|>", "left")


def test_chatml_template_and_encode_prompts():
    tok = build_bpe_tokenizer(_corpus(), vocab_size=512)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n")
    rendered = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True)
    assert rendered == (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"  # Qwen2.5's default
                        "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n")
    ids = encode_prompts(tok, ["Sam has 3 pens."], system_prompt=SYSTEM_PROMPT)[0]
    start = tok("<|im_start|>system")["input_ids"]
    end = tok("<|im_start|>assistant\n")["input_ids"]
    assert ids[: len(start)] == start and ids[-len(end):] == end
    assert start[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert "Sam has 3 pens." in tok.decode(ids)


def test_recipe_key_changes_with_any_field():
    assert ChatModelRecipe().key() == ChatModelRecipe().key()
    assert ChatModelRecipe(seed=1).key() != ChatModelRecipe().key()
    assert ChatModelRecipe().key().startswith("chat-")


def test_chat_model_is_a_qwen2_with_partial_skill(chat_model_dir):
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir)
    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    assert model.config.model_type == "qwen2"
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    info = json.loads((chat_model_dir / "grpo_lab_recipe.json").read_text())
    test = as_problems(read_jsonl(chat_model_dir / DATA_FOLDER / "test.jsonl"))
    accuracy = greedy_accuracy(model, tok, test[:256], max_new_tokens=info["max_new_tokens"],
                               reward_fn=math_answer_reward, system_prompt=SYSTEM_PROMPT)
    assert 0.1 < accuracy < 0.7, accuracy  # mixed groups: GRPO has something to learn from
