"""A second offline model, built like an instruct model: Qwen2, byte-level BPE, ChatML.

Real GRPO runs start from instruct models, whose prompts go through a chat template and whose
completions end with a special token; this model has the same moving parts, only small, warmed
up on GSM8K-format word problems and cached like the default model (docs/internals.md, "The
offline chat model").
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from ..data.prompts import encode_prompts
from ..data.rewards import math_answer_reward
from ..data.tasks import Problem, word_problems, write_word_problems
from ..util.files import read_jsonl
from .evaluation import greedy_accuracy
from .model_build import (
    RECIPE_FILE,
    build_provenance,
    build_threads,
    cached_model_path,
    sft_batch,
    supervised_warm_up,
)

SYSTEM_PROMPT = "Solve the problem. End with #### and the number."
"""The system message of every prompt (also the template's default, as Qwen2.5's has one)."""
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
DATA_FOLDER = "data"
"""Sub-folder of the built model holding `train.jsonl` and `test.jsonl`."""

# Qwen2's pre-tokenizer split: words with their leading space, every digit alone, punctuation
# runs, newlines. BPE merges never cross these pieces, so "19" is always "1" "9".
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2.5-Instruct's ChatML template without tools: a system turn first (a default one when the
# conversation has none), then each turn as <|im_start|>role\ncontent<|im_end|>\n, and with
# `add_generation_prompt` the opening of the assistant's turn, which the model completes.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ChatModelRecipe:
    """Everything that determines the chat model; its hash names the cache folder."""

    train_size: int = 2000
    """Word problems in `data/train.jsonl` (the warm-up draws its batches from them)."""
    test_size: int = 500
    """Word problems in `data/test.jsonl`: held out from the warm-up and its validation."""
    data_seed: int = 0
    """Seeds the word problems (see `write_word_problems`)."""
    vocab_size: int = 512
    """BPE vocabulary cap: 256 bytes, 3 specials, merges (the word problems need ~420 in all)."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    """Grouped-query attention: each KV head serves num_heads / num_kv_heads query heads."""
    intermediate_size: int = 384
    max_positions: int = 128
    """Longest prompt + answer, in tokens (~60 for a word problem in ChatML)."""
    seed: int = 0
    """Seeds the weights, the warm-up batches and the validation sample."""
    validation_size: int = 128
    """Word problems for the warm-up's stopping rule, outside train.jsonl and test.jsonl (a
    check of 128 costs about one step)."""
    warmup_target_accuracy: float = 0.32
    """Stop the warm-up once greedy accuracy on the validation sample reaches this."""
    warmup_max_steps: int = 400
    """Cap on warm-up steps (~150 reach the target)."""
    warmup_batch_size: int = 64
    warmup_lr: float = 3e-3
    """Peak AdamW learning rate (6e-3 stalled near 10 % in a trial)."""
    warmup_ramp_steps: int = 20
    """Linear learning-rate ramp from 0 over the first steps."""
    warmup_max_grad_norm: float = 1.0
    warmup_eval_every: int = 5
    """Validation interval on the way up (see `supervised_warm_up`)."""
    warmup_close_margin: float = 0.0
    """Validate every step this close to the target: never, here. Accuracy climbs ~1.5 points
    per 5 steps (no sudden jump as with the tiny model), and a check costs ~2 steps."""

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"chat-{digest[:12]}"


def build_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on `texts`, with ChatML specials and template, as Qwen2 sets it up."""
    core = Tokenizer(models.BPE())
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # bytes as symbols
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[ENDOFTEXT, IM_START, IM_END],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, no <unk>
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,  # generation stops where the assistant's turn ends
        pad_token=ENDOFTEXT,
        padding_side="left",  # generation appends on the right
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tokenizer_corpus(problems: list[Problem]) -> list[str]:
    """What the tokenizer learns merges from: the role names, the system prompt, the problems."""
    return ["system", "user", "assistant", SYSTEM_PROMPT] + [
        text for p in problems for text in (p.prompt, p.answer)]


def build_untrained_chat_model(recipe: ChatModelRecipe, tokenizer) -> Qwen2ForCausalLM:
    """A standard transformers Qwen2, so peft, TRL and vLLM-style loaders treat it like any
    model."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,  # Qwen2 prepends nothing: the template opens with <|im_start|>
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(recipe.seed)
    return Qwen2ForCausalLM(config)


def as_problems(rows: list[dict]) -> list[Problem]:
    """Word-problem rows as `Problem(prompt=question, answer=answer)`."""
    return [Problem(row["question"], row["answer"]) for row in rows]


def encode_questions(tokenizer, problems: list[Problem]) -> list[list[int]]:
    """Prompt ids of the questions, exactly as the trainers make them."""
    return encode_prompts(tokenizer, [p.prompt for p in problems], system_prompt=SYSTEM_PROMPT)


def _chat_sft_batch(problems: list[Problem], tokenizer, rng: random.Random, batch_size: int):
    """ChatML prompt + GSM8K answer + <|im_end|>, the loss on the answer and <|im_end|> only."""
    batch = rng.choices(problems, k=batch_size)
    answers = tokenizer([p.answer for p in batch], add_special_tokens=False)["input_ids"]
    return sft_batch(encode_questions(tokenizer, batch), answers, tokenizer)


def build_chat_model(recipe: ChatModelRecipe, out_dir: str | Path, progress: bool = True,
                     num_threads: int | None = None) -> dict:
    """Write the word problems, train the tokenizer, warm up the model, save all into `out_dir`.

    `num_threads`: torch threads for the build (None = leave as set).
    """
    start = time.perf_counter()
    with build_threads(num_threads):
        return _build(recipe, Path(out_dir), progress, start)


def _build(recipe: ChatModelRecipe, out_dir: Path, progress: bool, start: float) -> dict:
    paths = write_word_problems(out_dir / DATA_FOLDER, recipe.train_size, recipe.test_size,
                                recipe.data_seed)
    train, test = (as_problems(read_jsonl(paths[split])) for split in ("train", "test"))
    # The stopping rule's sample: new questions, so the test set stays unseen until the end.
    seen = {p.prompt for p in train + test}
    validation = as_problems(word_problems(recipe.validation_size, recipe.seed + 1_000_003,
                                           exclude=seen))  # a seed of its own
    tokenizer = build_bpe_tokenizer(tokenizer_corpus(train), recipe.vocab_size)
    model = build_untrained_chat_model(recipe, tokenizer)
    # Room for the longest answer of the validation sample and its <|im_end|>, plus a token.
    answer_lengths = tokenizer([p.answer for p in validation])["input_ids"]
    max_new_tokens = max(map(len, answer_lengths)) + 2
    rng = random.Random(recipe.seed)
    info = supervised_warm_up(
        model, recipe,
        next_batch=lambda: _chat_sft_batch(train, tokenizer, rng, recipe.warmup_batch_size),
        validation_accuracy=lambda: greedy_accuracy(
            model, tokenizer, validation, max_new_tokens=max_new_tokens,
            reward_fn=math_answer_reward, system_prompt=SYSTEM_PROMPT),
        progress=progress, close_margin=recipe.warmup_close_margin,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info.update(
        recipe=asdict(recipe),
        num_parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
        max_new_tokens=max_new_tokens,
        system_prompt=SYSTEM_PROMPT,
        build_seconds=round(time.perf_counter() - start, 2),
        built_with=build_provenance(),
    )
    (out_dir / RECIPE_FILE).write_text(json.dumps(info, indent=2))
    return info


def chat_model_path(recipe: ChatModelRecipe | None = None, rebuild: bool = False,
                    progress: bool = True, num_threads: int | None = None,
                    source: str = "reference") -> Path:
    """Path of the cached chat model for `recipe`: the shipped reference model when the recipe
    has one (the default recipe does), else built here first (atomically); `source="build"`
    builds it on this machine (see `tiny_model_path`).

    Its word problems are in `chat_model_path() / "data"`: `train.jsonl` and `test.jsonl`.
    """
    recipe = recipe or ChatModelRecipe()
    return cached_model_path(
        recipe.key(),
        lambda staging: build_chat_model(recipe, staging, progress=progress,
                                         num_threads=num_threads),
        rebuild=rebuild, source=source,
    )
