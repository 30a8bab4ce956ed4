"""grpo_lab_course.token_plots: a chat template's tokens, coloured by role, read from the
tokenizer's own output (a small byte-level BPE with ChatML, built as notebook 09's model's)."""

import matplotlib

matplotlib.use("Agg")
import pytest

from grpo_lab.model.chat_model import SYSTEM_PROMPT, build_bpe_tokenizer
from grpo_lab_course.token_plots import (
    ROLE_COLOURS,
    chat_token_roles,
    plot_chat_tokens,
    token_rows,
)

MESSAGES = [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many now?"},
            {"role": "assistant", "content": "3 + 4 = 7\n#### 7"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_bpe_tokenizer(["system", "user", "assistant", SYSTEM_PROMPT,
                                MESSAGES[1]["content"], MESSAGES[2]["content"]], vocab_size=300)


def test_tokens_are_the_templates_own_ids_and_text(tokenizer):
    tokens = chat_token_roles(tokenizer, MESSAGES)
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert [t.id for t in tokens] == list(ids)
    assert "".join(t.text for t in tokens) == tokenizer.apply_chat_template(MESSAGES,
                                                                            tokenize=False)


def test_each_messages_content_carries_its_role_and_the_markup_is_template(tokenizer):
    tokens = chat_token_roles(tokenizer, MESSAGES)
    for message in MESSAGES:
        text = "".join(t.text for t in tokens if t.role == message["role"])
        assert text == message["content"], message["role"]
    markup = [t.text for t in tokens if t.role == "template"]
    assert markup.count("<|im_start|>") == 3 and markup.count("<|im_end|>") == 3
    # the generation prompt is markup: the assistant's turn opened, nothing of it written
    prompt = chat_token_roles(tokenizer, MESSAGES[:2], add_generation_prompt=True)
    tail = [t for t in prompt if t.role != "template"][-1]
    opened = "".join(t.text for t in prompt[prompt.index(tail) + 1:])
    assert opened == "<|im_end|>\n<|im_start|>assistant\n", opened


def test_the_plot_draws_one_box_per_token_in_its_roles_colour(tokenizer):
    tokens = chat_token_roles(tokenizer, MESSAGES)
    fig = plot_chat_tokens(tokens, width=40)
    boxes = sorted((p for p in fig.axes[0].patches if p.get_gid() is not None),
                   key=lambda p: int(p.get_gid()))
    assert len(boxes) == len(tokens)
    for box, token in zip(boxes, tokens):
        assert matplotlib.colors.to_hex(box.get_facecolor()) == ROLE_COLOURS[token.role].lower()
    rows = token_rows(tokens, width=40)
    assert sum(len(r) for r in rows) == len(tokens)
    assert all("\n" not in t.text for row in rows for t in row[:-1])  # a newline ends its row
