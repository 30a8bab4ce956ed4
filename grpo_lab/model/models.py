"""Which model a name means, and loading any causal LM with its tokenizer.

Every entry point takes a model by name (`--model`, `GRPOConfig.model`, `grpo-lab serve MODEL`):
grpo_lab's own models by short name (`MADE_MODELS`: made once into `<GRPO_LAB_HOME>/models/`,
offline), anything else as transformers takes it (a local folder, or a hub id).

Left padding (generation continues the prompt); a tokenizer without a pad token pads with EOS.
"""

from __future__ import annotations

from pathlib import Path

from .pretrained import SMOLLM2

MADE_MODELS = ("tiny", "tiny-chat", "chat", SMOLLM2)
"""grpo_lab's models by short name: `tiny` (the shipped 1M-parameter Llama of the built-in
tasks), `tiny-chat` (alias `chat`: the shipped Qwen2-shaped chat model of notebook 09's word
problems), `smollm2-135m` (SmolLM2-135M-Instruct from a PyPI wheel, grpo_lab.model.pretrained).
Each machine keeps them in its own cache folder, named the same everywhere."""


def model_folder(model: str | Path, *, task: str = "addition", difficulty: int | None = None,
                 progress: bool = False) -> str:
    """A model as transformers (and vLLM) load it: grpo_lab's models by their cache folder,
    made first if needed; anything else as given. `task` and `difficulty` pick the tiny model."""
    model = str(model)
    if model == "tiny":
        from .tiny_model import TinyModelRecipe, tiny_model_path

        return str(tiny_model_path(TinyModelRecipe(task=task, difficulty=difficulty),
                                   progress=progress))
    if model in ("tiny-chat", "chat"):
        from .chat_model import chat_model_path

        return str(chat_model_path(progress=progress))
    if model == SMOLLM2:
        from .pretrained import smollm2_path

        return str(smollm2_path(progress=progress))
    return model


def made_model_folder_name(model: str | Path, *, task: str = "addition",
                           difficulty: int | None = None) -> str | None:
    """The cache folder's name of one of grpo_lab's models (`MADE_MODELS`), the same on every
    machine, worked out without making the model; None for any other model."""
    model = str(model)
    if model == "tiny":
        from .tiny_model import TinyModelRecipe

        return TinyModelRecipe(task=task, difficulty=difficulty).key()
    if model in ("tiny-chat", "chat"):
        from .chat_model import ChatModelRecipe

        return ChatModelRecipe().key()
    if model == SMOLLM2:
        from .pretrained import FOLDER

        return FOLDER
    return None


def load_model_and_tokenizer(model: str | Path, device: str = "cpu", dtype=None):
    """Load any causal LM (a name of `MADE_MODELS`, a local folder or a hub id) and its
    tokenizer."""
    from transformers import AutoModelForCausalLM

    model = model_folder(model)
    tokenizer = load_tokenizer(model)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    lm = AutoModelForCausalLM.from_pretrained(model, **kwargs).to(device)
    return lm, tokenizer


def load_tokenizer(model: str | Path):
    """A model's tokenizer, padding on the left (a pad token of its end token where it has
    none), as generation and the trainers use it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def tokenizer_of(model):
    """The tokenizer of a model loaded without one, from where its config says it came
    (`config._name_or_path`), as TRL loads a `processing_class` left out; a ValueError naming
    what to pass where that folder or id holds no tokenizer."""
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not source:
        raise ValueError("a model object passed without its tokenizer, and its config does not "
                         "say where it came from: pass processing_class=tokenizer (TRL's "
                         "keyword) or tokenizer=")
    try:
        return load_tokenizer(model_folder(source))
    except (OSError, ValueError) as exc:
        raise ValueError(f"a model object passed without its tokenizer: none loads from "
                         f"{source!r}, where its config says it came from ({exc}); pass "
                         "processing_class=tokenizer (TRL's keyword) or tokenizer=") from None
