"""A character-level tokenizer for the tiny offline model.

Built with the `tokenizers` library and wrapped as a transformers `PreTrainedTokenizerFast`, so
that `AutoTokenizer.from_pretrained(path)` loads it like any hub tokenizer.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# Every character any grpo_lab task writes: digits, operators, separators and space.
ALPHABET = "0123456789+-*=,:> "

# The chat template renders messages as plain text after <bos>: the tiny model has no roles.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
)


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """One token per character, 4 specials first, `<bos>` prepended, left padding."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(alphabet))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char alone
    core.decoder = decoders.Fuse()  # join characters back without separators
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # generation appends on the right
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
