"""A chat template's tokens, coloured by whose text they carry: system, user, assistant, or the
template's own markup (`<|im_start|>`, the role names, `<|im_end|>`, newlines).

`chat_token_roles(tokenizer, messages)` reads the tokenizer's own output: the ids
`apply_chat_template` makes, each decoded back to the characters it covers, and the role of the
message whose content those characters belong to ("template" for the rest).
`plot_chat_tokens(tokens)` draws them as coloured boxes, one row per line of the rendered text.
Taught by notebook 09.
"""

from __future__ import annotations

from typing import NamedTuple

ROLE_COLOURS = {  # Okabe-Ito: distinguishable with every common colour-vision deficiency
    "system": "#E69F00",
    "user": "#56B4E9",
    "assistant": "#009E73",
    "template": "#D0D0D0",
}


class Token(NamedTuple):
    """One token of a rendered conversation: its id, the text it decodes to, and its role."""

    id: int
    text: str
    role: str


def _token_spans(tokenizer, ids: list[int]) -> list[tuple[int, int]]:
    """Each token's [start, end) in `tokenizer.decode(ids)`: the growth of the decoded prefix
    (byte-level tokens that split a character decode whole only with their neighbours)."""
    spans, previous = [], 0
    for k in range(len(ids)):
        end = len(tokenizer.decode(ids[:k + 1]))
        spans.append((previous, max(previous, end)))
        previous = max(previous, end)
    return spans


def _content_spans(text: str, messages: list[dict]) -> list[tuple[int, int, str]]:
    """Where each message's content sits in the rendered text, found in order."""
    spans, cursor = [], 0
    for message in messages:
        content = message["content"]
        start = text.find(content, cursor) if content else -1
        if start < 0:
            raise ValueError(f"the template does not write this {message['role']} message's "
                             f"content as it is: {content[:60]!r}")
        spans.append((start, start + len(content), message["role"]))
        cursor = start + len(content)
    return spans


def chat_token_roles(tokenizer, messages: list[dict], *,
                     add_generation_prompt: bool = False) -> list[Token]:
    """The tokens of `messages` rendered by the tokenizer's chat template, each with the role of
    the message whose content it carries, or "template" for the template's markup."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # newer transformers: a BatchEncoding
        ids = ids["input_ids"]
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids)
    contents = _content_spans(text, messages)
    tokens = []
    for token_id, (start, end) in zip(ids, _token_spans(tokenizer, ids)):
        role = next((r for s, e, r in contents if start < e and s < end), "template")
        tokens.append(Token(token_id, text[start:end], role))
    return tokens


def shown(text: str) -> str:
    """A token's text as drawn: a space as a middle dot, a newline as an arrow."""
    return text.replace(" ", "\u00b7").replace("\n", "\u21b5") or "\u2205"


def token_rows(tokens: list[Token], width: int = 64) -> list[list[Token]]:
    """The tokens laid out in rows: a new row after a newline, or when the next token would
    pass `width` characters."""
    rows, row, used = [], [], 0
    for token in tokens:
        size = len(shown(token.text)) + 1
        if row and used + size > width:
            rows.append(row)
            row, used = [], 0
        row.append(token)
        used += size
        if "\n" in token.text:
            rows.append(row)
            row, used = [], 0
    if row:
        rows.append(row)
    return rows


def plot_chat_tokens(tokens: list[Token], width: int = 64, title: str | None = None):
    """The tokens as boxes coloured by role (`ROLE_COLOURS`), in reading order; a legend counts
    each role's tokens. Returns the figure; each token's box is a patch whose `gid` is its
    index in `tokens`."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    rows = token_rows(tokens, width)
    char_w, row_h = 0.09, 0.34  # inches per character, per row
    fig, ax = plt.subplots(figsize=(max(6.0, width * char_w + 0.4), len(rows) * row_h + 1.2))
    index = 0
    for y, row in enumerate(rows):
        x = 0.0
        for token in row:
            label = shown(token.text)
            box = Rectangle((x, -y - 0.85), len(label) + 0.6, 0.7, edgecolor="white",
                            facecolor=ROLE_COLOURS[token.role], linewidth=1.0, gid=str(index))
            ax.add_patch(box)
            ax.text(x + 0.3, -y - 0.5, label, va="center", ha="left", family="monospace",
                    fontsize=8)
            x += len(label) + 0.7
            index += 1
    ax.set_xlim(-0.2, width + 1)
    ax.set_ylim(-len(rows) - 0.1, 0.1)
    ax.axis("off")
    counts = {role: sum(t.role == role for t in tokens) for role in ROLE_COLOURS}
    ax.legend(handles=[Patch(color=c, label=f"{role} ({counts[role]} tokens)")
                       for role, c in ROLE_COLOURS.items()],
              loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, frameon=False, fontsize=9)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
