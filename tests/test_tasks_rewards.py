"""Tasks (held-out sets, difficulty) and reward functions (TRL signature, never raise)."""

import pickle
import random

import pytest

from grpo_lab.data import rewards as R
from grpo_lab.data.tasks import AdditionTask, PrefixedTask, SortTask, few_shot_prefix, make_task


def test_addition_is_zero_padded_and_correct():
    task = AdditionTask(digits=2, eval_size=50)
    for p in task.sample_batch(random.Random(0), 100):
        a, b = p.prompt[:-1].split("+")
        assert len(a) == len(b) == 2 and p.answer == f"{int(a) + int(b):03d}"


def test_sort_task_and_difficulty():
    task = SortTask(length=5, eval_size=20)
    p = task.sample(random.Random(1))
    digits = p.prompt[:-1].split(",")
    assert len(digits) == 5 and p.answer == ",".join(sorted(digits))
    assert make_task("addition", 3).max_answer_chars == 4


def test_eval_set_is_fixed_and_never_sampled_for_training():
    task = AdditionTask(digits=1, eval_size=30)  # 100 possible problems: collisions are likely
    assert task.eval_set() == AdditionTask(digits=1, eval_size=30).eval_set()
    held = {p.prompt for p in task.eval_set()}
    assert len(held) == 30
    assert not held & {p.prompt for p in task.sample_batch(random.Random(0), 500)}


def test_few_shot_prompts_share_a_template_and_keep_the_tasks_problems():
    bare, shots = make_task("addition", eval_size=40), make_task("addition", eval_size=40,
                                                                 few_shot=3)
    prefix = shots.prefix
    assert prefix == few_shot_prefix(bare, 3) and len(prefix) == 3 * len("12+34=046,")
    for example in prefix.rstrip(",").split(","):  # each example is solved correctly
        a, b, total = example.replace("+", " ").replace("=", " ").split()
        assert int(a) + int(b) == int(total)
    assert [p.answer for p in shots.eval_set()] == [p.answer for p in bare.eval_set()]
    assert [p.prompt for p in shots.eval_set()] == [prefix + p.prompt for p in bare.eval_set()]
    # Training draws the bare task's problems, in the same order, behind the prefix.
    drawn = shots.sample_batch(random.Random(7), 200)
    assert [p.prompt for p in drawn] == [prefix + p.prompt
                                         for p in bare.sample_batch(random.Random(7), 200)]
    assert not {p.prompt for p in drawn} & {p.prompt for p in shots.eval_set()}
    assert shots.max_answer_chars == bare.max_answer_chars and shots.name == "addition"


def test_a_few_shot_template_fills_whole_kv_blocks_every_prompt_shares():
    from grpo_lab.model.tiny_model import build_char_tokenizer
    from grpo_lab.serve.block_hashes import chained_block_hashes

    tokenizer = build_char_tokenizer()
    task = make_task("addition", eval_size=20, few_shot=3)  # <bos> + 30 characters of examples
    ids = [tokenizer(p.prompt)["input_ids"] for p in task.eval_set()]
    hashes = [tuple(chained_block_hashes(i, "", 4)) for i in ids]
    assert len({h[:7] for h in hashes}) == 1  # 28 template tokens: 7 blocks of 4 in common
    assert len({h[7:] for h in hashes}) == len(ids)  # then every prompt is its own


def test_prefix_and_few_shot_bad_input_fail_clearly():
    from grpo_lab.data.datasets import DatasetTask
    from grpo_lab.data.tasks import Problem
    from grpo_lab.train.config import GRPOConfig

    with pytest.raises(ValueError, match="few_shot must be >= 0"):
        GRPOConfig(few_shot=-1)
    with pytest.raises(ValueError, match="non-empty text"):
        PrefixedTask(AdditionTask(), "")
    chats = DatasetTask([Problem([{"role": "user", "content": f"{i}?"}], str(i))
                         for i in range(10)], eval_fraction=0.5)
    with pytest.raises(ValueError, match="needs text prompts"):
        PrefixedTask(chats, "Answer briefly. ")
    assert GRPOConfig(few_shot=2).make_task().prefix == few_shot_prefix(AdditionTask(), 2)


def test_unknown_task_and_bad_difficulty_fail_clearly():
    with pytest.raises(ValueError, match="unknown task"):
        make_task("chess")
    with pytest.raises(ValueError, match="digits"):
        AdditionTask(digits=0)


def test_exact_match_reward_signature_and_formats():
    assert R.exact_match_reward(["052", " 052 ", "52", ""], answer=["052"] * 4) == [1, 1, 0, 0]
    conversational = [[{"role": "assistant", "content": "052"}]]
    assert R.exact_match_reward(conversational, answer=["052"], prompts=["x"]) == [1.0]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is #### 1,234", "1,234"),
        (r"thus \boxed{\frac{7}{2}} done", r"\frac{7}{2}"),
        (r"\boxed{x^{2}} and \boxed{12}", "12"),
        ("we get 3 apples, then 5.5 pears", "5.5"),
        ("no digits here", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert R.extract_final_answer(text) == expected


def test_math_answer_reward_compares_numerically():
    completions = ["#### 1,234", r"\boxed{3.50}", r"\boxed{\frac{7}{2}}", "it is 41", "junk"]
    answers = ["1234", "3.5", "3.5", "#### 42", "7"]
    assert R.math_answer_reward(completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("reward", [R.exact_match_reward, R.math_answer_reward])
def test_rewards_never_raise_on_malformed_output(reward):
    junk = [None, 42, [], [{"no": "content"}], "\\boxed{", "1/0", "#### ", "\x00" * 5]
    assert reward(junk, answer=["1"] * len(junk)) == [0.0] * len(junk)


def test_rewards_are_picklable():
    for fn in R.REWARDS.values():
        assert pickle.loads(pickle.dumps(fn)) is fn



def test_sum_form_asks_a_chat_model_and_scores_only_the_asked_form():
    import re

    from grpo_lab.data.prompts import prompt_key
    from grpo_lab.data.rewards import exact_match_reward
    from grpo_lab.data.tasks import make_task
    from grpo_lab.train.config import GRPOConfig

    task = make_task("sum_form", 20, eval_size=64)
    held_out = task.eval_set()
    problem = held_out[0]
    system, example, worked, question = problem.prompt
    assert system["role"] == "system" and worked == {"role": "assistant", "content": "3 + 5 = 8"}
    a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", question["content"]).groups())
    assert 1 <= a <= 20 and 1 <= b <= 20 and problem.answer == f"{a} + {b} = {a + b}"
    replies = [problem.answer, f" {problem.answer}\n", problem.answer + ".", str(a + b),
               f"{a} + {b} = {a + b + 1}"]
    assert exact_match_reward(replies, answer=[problem.answer] * 5) == [1, 1, 0, 0, 0]
    seen = {prompt_key(p.prompt) for p in held_out}
    training = task.sample_batch(random.Random(0), 200)
    assert not seen & {prompt_key(p.prompt) for p in training}  # never a held-out problem
    with pytest.raises(ValueError, match="smollm2-135m"):
        GRPOConfig(task="sum_form")  # the tiny model has no chat template
