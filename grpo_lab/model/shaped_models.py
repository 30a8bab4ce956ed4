"""Random-weight models at real models' shapes: Qwen2.5-0.5B, the blog's Qwen2.5-Math-1.5B.

grpo_lab's own models are tiny (a 22-token vocabulary); the recipe's model has 1.5 B parameters
and a 151,936-row vocabulary. To show that the code fits and runs at those shapes without the hub,
`build_shaped_model` writes a transformers `Qwen2ForCausalLM` with a published configuration and
random (seeded) weights, plus a tokenizer, into a folder that `load_model_and_tokenizer` loads:

- the tokenizer is the chat model's (grpo_lab.model.chat_model): byte-level BPE with Qwen2's
  pre-tokenizer, ChatML specials and template, trained on word problems, then padded with filler
  tokens to Qwen2.5's 151,665 entries, so that sampled ids decode to text of a realistic length;
- the model's vocabulary is padded past the tokenizer to the config's 151,936 rows, as Qwen2.5's
  is (ids 151,665 and up decode to nothing);
- the weights are drawn the way Qwen2's `_init_weights` draws them (normal(0, 0.02) for every
  matrix, zero biases, unit norms), straight into memory allocated once (the model is built on
  the meta device), so a 0.5B model takes seconds; saved as safetensors.

Built folders are cached in `grpo_lab_home()/models/shaped-<name>-<dtype>-seed<N>-<hash>`, with
word problems in GSM8K format beside them (`data/train.jsonl`, `data/test.jsonl`) that
`grpo-lab train --model <folder> --dataset <folder>/data/train.jsonl` trains on.
On random weights a completion almost never samples <|im_end|> (1 id in 151,936): it runs to
`max_new_tokens`, the worst case for memory and time.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..data.tasks import write_word_problems
from ..util.files import read_jsonl
from .chat_model import DATA_FOLDER, as_problems, build_bpe_tokenizer, tokenizer_corpus
from .model_build import RECIPE_FILE, build_provenance, build_threads, cached_model_path

BPE_VOCAB = 512
"""The trained part of the tokenizer (the word problems need ~420 entries); the rest is filler."""
TRAIN_SIZE, TEST_SIZE = 256, 64
"""Word problems written beside the model (`data/train.jsonl`, `data/test.jsonl`)."""


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2-style configuration; the fields carry `transformers.Qwen2Config`'s names, so
    grpo_lab.model.memory_model reads a shape and a loaded model's config alike."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Grouped-query attention: each KV head serves num_attention_heads / num_key_value_heads."""
    intermediate_size: int
    vocab_size: int = 151_936
    """Rows of the embedding and of the LM head: Qwen2.5's tokenizer, padded to a multiple of
    128 (151,936 = 1,187 x 128)."""
    tokenizer_size: int = 151_665
    """Entries of the tokenizer (Qwen2.5's: 151,643 BPE tokens and 22 specials)."""
    tie_word_embeddings: bool = True
    """The LM head is the embedding matrix (Qwen2.5 0.5B and 1.5B)."""
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32_768
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    """Standard deviation of the random weights (Qwen2's `_init_weights`)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


QWEN25_05B = ModelShape("qwen2.5-0.5b", hidden_size=896, num_hidden_layers=24,
                        num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864)
"""Qwen/Qwen2.5-0.5B(-Instruct)'s config.json: 494,032,768 parameters (tied embeddings)."""
QWEN25_MATH_15B = ModelShape("qwen2.5-math-1.5b", hidden_size=1536, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2,
                             intermediate_size=8960, rope_theta=10_000.0,
                             max_position_embeddings=4096)
"""Qwen/Qwen2.5-Math-1.5B's config.json, the blog's model: 1,543,714,304 parameters (tied)."""
VOCAB_ONLY = ModelShape("vocab-only", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128)
"""Qwen2.5's vocabulary on a tiny body (~9.9 M parameters, ~98 % of them the embedding): what a
151,936-column logits matrix costs, in tests and benchmarks that take seconds."""
SHAPES = {shape.name: shape for shape in (QWEN25_05B, QWEN25_MATH_15B, VOCAB_ONLY)}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: str | torch.dtype) -> str:
    """`torch.bfloat16` or "bfloat16" -> "bfloat16"."""
    name = DTYPE_NAMES.get(dtype, dtype)
    if name not in DTYPE_NAMES.values():
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPE_NAMES.values())}")
    return name


def shape_key(shape: ModelShape, seed: int = 0, dtype: str | torch.dtype = "float32") -> str:
    """The cache folder's name: the shape's name, dtype and seed, and a hash of everything that
    decides the build."""
    fields = {"shape": asdict(shape), "seed": seed, "dtype": dtype_name(dtype),
              "bpe_vocab": BPE_VOCAB, "data": [TRAIN_SIZE, TEST_SIZE]}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    return f"shaped-{shape.name}-{dtype_name(dtype)}-seed{seed}-{digest}"


def qwen2_config(shape: ModelShape, tokenizer):
    """The transformers config of `shape`, its special ids taken from `tokenizer`."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps, initializer_range=shape.initializer_range,
        tie_word_embeddings=shape.tie_word_embeddings, use_sliding_window=False,
        sliding_window=None,
        bos_token_id=None,  # Qwen2 prepends nothing: the template opens with <|im_start|>
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def random_model(config, seed: int = 0, dtype: str | torch.dtype = "float32"):
    """A `Qwen2ForCausalLM` of `config` with seeded random weights, in `dtype`.

    The modules are laid out on the meta device, their memory allocated once (`to_empty`), and
    each parameter drawn in place, in `named_parameters` order: about half the time of
    `Qwen2ForCausalLM(config)` and its init pass (0.5B shape, one thread: 2.1-2.7 s against 5.4 s).
    """
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype_name(dtype)))
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the head memory of its own: share the embedding again
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # tied weights are listed once
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:  # embedding and linear weights
            param.normal_(0.0, config.initializer_range, generator=generator)
    if config.pad_token_id is not None:  # nn.Embedding's padding_idx row starts at zero
        model.get_input_embeddings().weight[config.pad_token_id].zero_()
    # RoPE's inverse frequencies are buffers (never saved) that to_empty left unset: a new
    # rotary module, made off the meta device, computes them.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()


def pad_tokenizer_file(path: str | Path, size: int) -> int:
    """Add filler tokens to a saved BPE tokenizer (`tokenizer.json`) until it has `size` entries;
    returns how many were added.

    The fillers are byte-level words (" aaa", " aab", ...): no merge produces them, so encoding
    is unchanged, and an id sampled from them decodes to a word, as a real vocabulary's would.
    """
    path = Path(path)
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    specials = {t["id"] for t in data["added_tokens"]} - set(vocab.values())
    missing = size - len(vocab) - len(specials)
    if missing < 0:
        raise ValueError(f"the tokenizer has {len(vocab) + len(specials)} entries, over {size}")
    words = ("Ġ" + "".join(letters) for n in itertools.count(3)
             for letters in itertools.product(string.ascii_lowercase, repeat=n))
    fillers = itertools.islice((w for w in words if w not in vocab), missing)
    next_id = max(vocab.values()) + 1
    for offset, word in enumerate(fillers):
        vocab[word] = next_id + offset
    path.write_text(json.dumps(data, ensure_ascii=False))
    return missing


def build_shaped_model(shape: ModelShape, folder: str | Path, seed: int = 0,
                       dtype: str | torch.dtype = "float32", num_threads: int | None = None
                       ) -> dict:
    """Write word problems, a tokenizer and a random-weight `shape` model into `folder`; returns
    what the build recorded (also in its `grpo_lab_recipe.json`, written last)."""
    folder = Path(folder)
    start = time.perf_counter()
    with build_threads(num_threads):
        paths = write_word_problems(folder / DATA_FOLDER, TRAIN_SIZE, TEST_SIZE, seed)
        problems = as_problems(read_jsonl(paths["train"]))
        tokenizer = build_bpe_tokenizer(tokenizer_corpus(problems), BPE_VOCAB)
        tokenizer.save_pretrained(folder)
        pad_tokenizer_file(folder / "tokenizer.json", shape.tokenizer_size)
        tokenized = time.perf_counter()
        model = random_model(qwen2_config(shape, tokenizer), seed, dtype)
        drawn = time.perf_counter()
        model.save_pretrained(folder)
    saved = time.perf_counter()
    info = {
        "shape": asdict(shape), "seed": seed, "dtype": dtype_name(dtype),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_size": shape.tokenizer_size, "data": {k: str(p.relative_to(folder))
                                                         for k, p in paths.items()},
        "tokenizer_s": round(tokenized - start, 2), "init_s": round(drawn - tokenized, 2),
        "save_s": round(saved - drawn, 2), "build_seconds": round(saved - start, 2),
        "disk_bytes": sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()),
        "built_with": build_provenance(),
    }
    (folder / RECIPE_FILE).write_text(json.dumps(info, indent=2))
    return info


def shaped_model_path(shape: ModelShape | str, seed: int = 0, dtype: str | torch.dtype = "float32",
                      rebuild: bool = False, num_threads: int | None = None) -> Path:
    """The cached folder of `shape` (a ModelShape or a name in SHAPES) with weights drawn from
    `seed` in `dtype`, built first (atomically) if it is not there."""
    shape = SHAPES[shape] if isinstance(shape, str) else shape
    return cached_model_path(
        shape_key(shape, seed, dtype),
        lambda staging: build_shaped_model(shape, staging, seed, dtype, num_threads),
        rebuild=rebuild)


def dataset_files(model_path: str | Path) -> dict[str, Path]:
    """The word problems written beside a shaped model: {"train": ..., "test": ...} (.jsonl,
    GSM8K's `question` and `answer`), for GRPOConfig's `dataset` and `eval_split`."""
    folder = Path(model_path) / DATA_FOLDER
    return {split: folder / f"{split}.jsonl" for split in ("train", "test")}


def build_info(model_path: str | Path) -> dict:
    """What the build of a shaped model recorded (its `grpo_lab_recipe.json`)."""
    return json.loads((Path(model_path) / RECIPE_FILE).read_text())
