"""The offline default model: a ~1M-parameter Llama built locally and warmed up on a task.

GRPO needs groups with mixed rewards, so a random model (reward always 0) cannot learn. We give
the tiny model partial skill with a short supervised warm-up, stopping at a target held-out
accuracy (~30 %), and cache the result on disk keyed by the recipe, so every notebook and test
loads the same model with `from_pretrained(path)`, offline.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ..data.tasks import Task, make_task
from .evaluation import greedy_accuracy
from .model_build import (
    RECIPE_FILE,
    build_provenance,
    build_threads,
    cached_model_path,
    sft_batch,
    supervised_warm_up,
)


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that determines the tiny model; its hash names the cache folder."""

    task: str = "addition"
    """Task to warm up on (see `grpo_lab.data.tasks.TASKS`)."""
    difficulty: int | None = None
    """Task difficulty (digits for addition, length for sort); None = the task's default."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    max_positions: int = 64
    seed: int = 0
    """Seeds the weights and the warm-up batches."""
    warmup_target_accuracy: float = 0.32
    """Stop the warm-up once greedy accuracy on a validation sample reaches this."""
    warmup_max_steps: int = 800
    """Cap on warm-up steps (the steps needed vary 1.5-2x with the seed)."""
    warmup_batch_size: int = 128
    """Half the old 256: each step costs half, and only ~1.3x more steps are needed."""
    warmup_lr: float = 2e-3
    """Peak AdamW learning rate (2x the old 1e-3; 4e-3 overshoots the target, 6e-3 stalls)."""
    warmup_ramp_steps: int = 20
    """Linear learning-rate ramp from 0 over the first steps (the high peak diverges without it)."""
    warmup_max_grad_norm: float = 1.0
    warmup_eval_every: int = 5
    """Validation every 5 steps on the way up (every step close to the target, see warm_up)."""

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"{self.task}-{digest[:12]}"


def build_untrained_model(recipe: TinyModelRecipe, tokenizer) -> LlamaForCausalLM:
    """A standard transformers Llama, so peft, TRL and vLLM-style loaders treat it like any
    model."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(recipe.seed)
    return LlamaForCausalLM(config)


def _sft_batch(task: Task, tokenizer, rng: random.Random, batch_size: int):
    """A batch of task problems: prompt + answer + EOS, the loss on answer and EOS only."""
    problems = task.sample_batch(rng, batch_size)
    # One batched call each (the Rust tokenizer), not one call per row: ~10x less time per step.
    prompts = tokenizer([p.prompt for p in problems])["input_ids"]  # each starts with <bos>
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    return sft_batch(prompts, answers, tokenizer)


def warm_up(model, tokenizer, task: Task, recipe: TinyModelRecipe, progress: bool = True) -> dict:
    """Supervised warm-up until validation greedy accuracy reaches the target (or the step cap)."""
    rng = random.Random(recipe.seed)
    validation = task.sample_batch(random.Random(recipe.seed + 1), 256)  # not the eval set
    return supervised_warm_up(
        model, recipe,
        next_batch=lambda: _sft_batch(task, tokenizer, rng, recipe.warmup_batch_size),
        validation_accuracy=lambda: greedy_accuracy(
            model, tokenizer, validation, max_new_tokens=task.max_answer_chars + 1),
        progress=progress,
    )


def build_tiny_model(recipe: TinyModelRecipe, out_dir: str | Path, progress: bool = True,
                     num_threads: int | None = None) -> dict:
    """Build tokenizer and model, warm up, and `save_pretrained` both into `out_dir`.

    `num_threads`: torch threads for the build (None = leave as set). Give it every core only
    when nothing else runs: the build alone takes ~40 s on 2 cores with both, ~60 s with one.
    """
    start = time.perf_counter()
    with build_threads(num_threads):
        return _build(recipe, Path(out_dir), progress, start)


def _build(recipe: TinyModelRecipe, out_dir: Path, progress: bool, start: float) -> dict:
    task = make_task(recipe.task, recipe.difficulty)
    tokenizer = build_char_tokenizer()
    model = build_untrained_model(recipe, tokenizer)
    info = warm_up(model, tokenizer, task, recipe, progress=progress)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info.update(
        recipe=asdict(recipe),
        num_parameters=sum(p.numel() for p in model.parameters()),
        build_seconds=round(time.perf_counter() - start, 2),
        built_with=build_provenance(),
    )
    (out_dir / RECIPE_FILE).write_text(json.dumps(info, indent=2))
    return info


def tiny_model_path(
    recipe: TinyModelRecipe | None = None, rebuild: bool = False, progress: bool = True,
    num_threads: int | None = None, source: str = "reference",
) -> Path:
    """Path of the cached tiny model for `recipe`: the shipped reference model when the recipe
    has one (the default recipe does), else built here first (atomically).

    `source="build"` builds it from the recipe on this machine (`<key>-built`): the same recipe,
    but its last bits, and so its accuracy, follow this processor (see `model_build`).
    """
    recipe = recipe or TinyModelRecipe()
    return cached_model_path(
        recipe.key(),
        lambda staging: build_tiny_model(recipe, staging, progress=progress,
                                         num_threads=num_threads),
        rebuild=rebuild, source=source,
    )


# ------------------------------------------------------------ the tiny model's character tokenizer
# A character-level tokenizer for the tiny offline model.
#
# Built with the `tokenizers` library and wrapped as a transformers `PreTrainedTokenizerFast`, so
# that `AutoTokenizer.from_pretrained(path)` loads it like any hub tokenizer.


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
