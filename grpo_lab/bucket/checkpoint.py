"""Trainer checkpoints in the bucket, so that a preempted trainer job resumes where it stopped.

A checkpoint (`checkpoints/step-000012/`: adapter or model, optimizer, state, RNGs: the CPU's,
and on a GPU the CUDA ones) is written atomically, as adapters are, and always holds full
weights and optimizer state, so one written by N trainer processes loads under M
(docs/internals.md, "Checkpoints").
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from ..util.files import atomic_folder

STEP_RE = re.compile(r"step-(\d+)")
CUDA_RNG_FILE = "cuda_rng.pt"
"""The CUDA generators' states, one per GPU, in a checkpoint saved where CUDA was available
(optional: a checkpoint from a CPU run has none, and a CPU resume skips it)."""


class Checkpoints:
    """`save(trainer, state)` / `latest()` / `load(path, trainer)` under `root`."""

    def __init__(self, root: str | os.PathLike, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root).absolute()
        self.keep = keep
        self.root.mkdir(parents=True, exist_ok=True)
        self.removed_partial = [p.name for p in self.root.glob(".step-*.tmp-*")]
        for leftover in self.root.glob(".step-*.tmp-*"):  # a trainer killed mid-write
            shutil.rmtree(leftover, ignore_errors=True)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (hidden temp dirs are never listed)."""
        found = (STEP_RE.fullmatch(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def save(self, trainer, state: dict) -> Path:
        """Write the trainer's weights, optimizer and `state` (JSON-ready) as one checkpoint."""
        model, optimizer_state = full_state(trainer)  # every process: FSDP2 gathers
        step = trainer.step_count
        final = self.path(step)
        if final.exists():
            return final
        with atomic_folder(final) as staging:  # readers see nothing or everything
            model.save_pretrained(staging / "adapter")
            torch.save(optimizer_state, staging / "optimizer.pt")
            torch.save(torch.get_rng_state(), staging / "rng.pt")
            if torch.cuda.is_available():  # one state per GPU this process sees
                torch.save(torch.cuda.get_rng_state_all(), staging / CUDA_RNG_FILE)
            full = {"step": step, "version": getattr(trainer, "version", 0),  # async only
                    "sampler_rng": _encode_random_state(trainer.rng.getstate()), **state}
            (staging / "state.json").write_text(json.dumps(full, indent=2))
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    @staticmethod
    def read_state(path: str | os.PathLike) -> dict:
        return json.loads((Path(path) / "state.json").read_text())

    @staticmethod
    def load(path: str | os.PathLike, trainer) -> dict:
        """Restore weights, optimizer, step, version and RNGs into `trainer`; returns state.json."""
        from safetensors.torch import load_file

        path = Path(path)
        state = Checkpoints.read_state(path)
        weights = path / "adapter" / "adapter_model.safetensors"
        processes = getattr(trainer, "processes", None)
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True)
        if processes is not None and processes.is_fsdp:  # sharded weights: torch's loader
            processes.load_full_state(trainer.train_model, trainer.optimizer, load_file(
                weights if weights.exists() else path / "adapter" / "model.safetensors"),
                optimizer_state)
        elif weights.exists():  # LoRA: PEFT's file names lack the adapter name ("default")
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(trainer.model, load_file(weights))
        else:
            loaded = load_file(path / "adapter" / "model.safetensors")
            trainer.model.load_state_dict(loaded, strict=False)
        if processes is None or not processes.is_fsdp:
            trainer.optimizer.load_state_dict(optimizer_state)
        torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True))
        if (path / CUDA_RNG_FILE).exists() and torch.cuda.is_available():
            cuda_states = torch.load(path / CUDA_RNG_FILE, weights_only=True)
            # as many GPUs as there are here (a checkpoint may come from a larger machine)
            torch.cuda.set_rng_state_all(cuda_states[:torch.cuda.device_count()])
        trainer.rng.setstate(_decode_random_state(state["sampler_rng"]))
        trainer.step_count = state["step"]
        trainer.version = state["version"]
        return state


def full_state(trainer) -> tuple:
    """(something that `save_pretrained`s the full weights, the optimizer's full state dict):
    gathered from every process under FSDP2 (all must call this; None on all but the main)."""
    processes = getattr(trainer, "processes", None)
    if processes is None:
        return trainer.model, trainer.optimizer.state_dict()
    return (processes.full_model(trainer.train_model, trainer.model),
            processes.optimizer_state(trainer.train_model, trainer.optimizer))


def _encode_random_state(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _decode_random_state(values: list):
    version, internal, gauss = values
    return (version, tuple(internal), gauss)
