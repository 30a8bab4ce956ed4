"""A checkpoint's RNGs: the CPU's always, the CUDA ones (every GPU) where CUDA is available, and a
checkpoint without them still loads (grpo_lab.bucket.checkpoint). CUDA is faked: torch.cuda's
RNG functions are replaced, so the save and restore paths run on this CPU."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save_file

from grpo_lab.bucket.checkpoint import CUDA_RNG_FILE, Checkpoints


class TinyModel(torch.nn.Linear):
    def save_pretrained(self, path):
        path.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), str(path / "model.safetensors"))


class FakeTrainer:
    """What Checkpoints reads and restores: a model, its optimizer, step, version, sampler RNG."""

    def __init__(self):
        self.model = TinyModel(3, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.step_count, self.version, self.rng = 5, 5, random.Random(0)


@pytest.fixture
def fake_cuda(monkeypatch):
    """Two GPUs' RNG states, each a byte tensor, kept in `states` (what set_rng_state_all got)."""
    states = {"current": [torch.tensor([1, 2], dtype=torch.uint8),
                          torch.tensor([3, 4], dtype=torch.uint8)], "set": None}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states["current"]))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda new: states.__setitem__("set", list(new)))
    return states


def test_cuda_rng_states_are_saved_and_restored(tmp_path, fake_cuda):
    path = Checkpoints(tmp_path).save(FakeTrainer(), {})
    assert (path / CUDA_RNG_FILE).exists() and (path / "rng.pt").exists()
    trainer = FakeTrainer()
    Checkpoints.load(path, trainer)
    assert [t.tolist() for t in fake_cuda["set"]] == [[1, 2], [3, 4]]  # every GPU's, in order
    assert trainer.step_count == 5


def test_a_checkpoint_from_more_gpus_restores_the_ones_here(tmp_path, fake_cuda, monkeypatch):
    path = Checkpoints(tmp_path).save(FakeTrainer(), {})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    Checkpoints.load(path, FakeTrainer())
    assert [t.tolist() for t in fake_cuda["set"]] == [[1, 2]]


def test_a_cpu_checkpoint_loads_where_cuda_is_available(tmp_path, monkeypatch):
    """Saved without CUDA (no cuda_rng.pt), loaded with it: the CUDA RNGs are left as they are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trainer = FakeTrainer()
    torch.manual_seed(7)
    path = Checkpoints(tmp_path).save(trainer, {})
    assert not (path / CUDA_RNG_FILE).exists()
    expected = torch.rand(3)
    touched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", touched.append)
    Checkpoints.load(path, FakeTrainer())
    assert touched == [] and torch.equal(torch.rand(3), expected)  # the CPU RNG is restored


def test_a_cuda_checkpoint_loads_on_a_cpu(tmp_path, fake_cuda, monkeypatch):
    path = Checkpoints(tmp_path).save(FakeTrainer(), {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    Checkpoints.load(path, FakeTrainer())
    assert fake_cuda["set"] is None
