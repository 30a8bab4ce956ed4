"""What every offline model build shares: a supervised warm-up to a target accuracy, and a cache.

GRPO needs groups with mixed rewards, so a random model (reward always 0) cannot learn. A build
gives a fresh model partial skill with a short supervised fine-tuning (SFT) on prompt + answer,
checking greedy accuracy on a validation sample as it goes and stopping once it reaches a target
(~30 %): enough right answers to reward, enough wrong ones to improve on.

The result is cached under `grpo_lab_home()/models/<recipe key>`, built in a staging folder that
is renamed into place, so every notebook and test loads the same model offline, and a crash or a
concurrent build never leaves a half-written model behind.

A build is not the same on every processor: float32 sums taken in another order (another kernel
level, another thread count) change the warm-up in its last bits, the stopping rule fires a step
earlier or later, and one recipe gives models from 25 % to 35 % accurate. So the default recipes
ship **reference models** (`grpo_lab/model/reference_models/<key>/`, built once, recipe and
provenance in their `grpo_lab_recipe.json`): `cached_model_path` copies the reference into the
cache instead of building, and every learner starts from the model the course's numbers describe.
`source="build"` builds from the recipe on this machine instead (into `<key>-built`, beside it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..util.files import atomic_folder
from ..util.home import grpo_lab_home

RECIPE_FILE = "grpo_lab_recipe.json"
"""Written last into a built model's folder: its presence means the build finished."""
REFERENCE_MODELS = Path(__file__).resolve().parent / "reference_models"
"""The shipped reference models, one folder per recipe key (package data)."""
SOURCES = ("reference", "build")
"""Where a model comes from: the shipped reference when its recipe has one (else a build), or a
build on this machine."""
TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


def sft_batch(prompt_ids: list[list[int]], answer_ids: list[list[int]], tokenizer):
    """Prompt + answer + EOS, right padded; the loss sees only answer and EOS tokens."""
    rows, labels = [], []
    for prompt, answer in zip(prompt_ids, answer_ids):
        answer = answer + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return input_ids, attention_mask, label_ids


def supervised_warm_up(model, recipe, next_batch: Callable[[], tuple],
                       validation_accuracy: Callable[[], float], progress: bool = True,
                       close_margin: float = 0.1) -> dict:
    """SFT on `next_batch()` until `validation_accuracy()` reaches the target (or the step cap).

    `recipe` is any recipe with the `warmup_*` fields of `TinyModelRecipe` (target accuracy,
    step cap, learning rate and its ramp, gradient clipping, validation interval).
    `close_margin`: validate every step once accuracy is this close to the target.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.warmup_lr)
    ramp = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min(1.0, (i + 1) / recipe.warmup_ramp_steps))
    model.train()
    accuracy, step = 0.0, 0
    bar = tqdm(range(1, recipe.warmup_max_steps + 1), desc="warm-up", disable=not progress)
    for step in bar:
        input_ids, attention_mask, labels = next_batch()
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.warmup_max_grad_norm)
        optimizer.step()
        ramp.step()
        optimizer.zero_grad(set_to_none=True)
        # Validate half as often while accuracy sits near 0 % (the first ~100 steps; a check
        # costs about one step), every `warmup_eval_every` steps on the way up, and every step
        # in the last `close_margin` before the target: the tiny model's accuracy jumps ~10
        # points in 5 steps there, and stopping at the first step past the target keeps every
        # build at 30-40 %.
        if accuracy < 0.1:
            every = 2 * recipe.warmup_eval_every
        elif accuracy < recipe.warmup_target_accuracy - close_margin:
            every = recipe.warmup_eval_every
        else:
            every = 1
        if step % every == 0:
            accuracy = validation_accuracy()
            bar.set_postfix(loss=f"{loss.item():.3f}", val_acc=f"{accuracy:.2f}")
            if accuracy >= recipe.warmup_target_accuracy:
                break
    model.eval()
    return {"warmup_steps": step, "warmup_val_accuracy": accuracy, "final_loss": loss.item()}


def build_provenance() -> dict:
    """What, besides the recipe, decided a build's last bits: the libraries, the kernel level
    torch chose (`ATEN_CPU_CAPABILITY` forces one), the threads, the processor."""
    import platform

    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "processor": _processor_name(),
    }


def _processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


@contextmanager
def build_threads(num_threads: int | None) -> Iterator[None]:
    """Run a build with `num_threads` torch threads (None = leave as set) and the tokenizers'
    thread pool off; both restored afterwards.

    On a few cores the Rust tokenizers' pool (batch encoding, BPE training) competes with torch's
    threads: the chat model's warm-up steps ran ~10x slower on 2 cores with it on.
    """
    threads_before = torch.get_num_threads()
    parallelism_before = os.environ.get(TOKENIZERS_PARALLELISM)
    os.environ[TOKENIZERS_PARALLELISM] = "false"  # read by tokenizers at each batch call
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        if parallelism_before is None:
            os.environ.pop(TOKENIZERS_PARALLELISM, None)
        else:
            os.environ[TOKENIZERS_PARALLELISM] = parallelism_before


def reference_model(key: str) -> Path | None:
    """The shipped reference model for a recipe key, or None when that recipe has none."""
    folder = REFERENCE_MODELS / key
    return folder if (folder / RECIPE_FILE).exists() else None


def cached_model_path(key: str, build: Callable[[Path], object], rebuild: bool = False,
                      source: str = "reference") -> Path:
    """The model of a recipe `key` in `grpo_lab_home()/models/`, made first if it is not there.

    `source="reference"`: the shipped reference model, copied into `models/<key>` (a build, as
    below, when the recipe has no reference). `source="build"`: `build(staging_folder)` on this
    machine, into `models/<key>-built` (never mistaken for the reference). `rebuild` makes it
    again. `build` must write `RECIPE_FILE` last; both land in a staging folder renamed into
    place, so a crash or a concurrent build never leaves a half-written model in the cache.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    reference = reference_model(key) if source == "reference" else None
    models_dir = grpo_lab_home() / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    path = models_dir / (key if source == "reference" else f"{key}-built")
    if path.exists() and rebuild:
        shutil.rmtree(path)
    if (path / RECIPE_FILE).exists():
        return path
    with atomic_folder(path, keep_existing=True) as staging:  # a concurrent build may win
        if reference is not None:
            shutil.copytree(reference, staging, dirs_exist_ok=True)
        else:
            build(staging)
    return path
