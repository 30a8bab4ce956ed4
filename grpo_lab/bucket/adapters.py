"""Adapter publishing through "the bucket": a folder every job sees at the same absolute path.

The trainer writes each policy version's LoRA adapter into the bucket and the servers load it
from the same path: no NCCL, no network between the jobs. `AdapterBucket.publish` writes into a
hidden temporary folder, opens up the permissions and renames it to `policy-vN` (atomic on one
filesystem); old versions are deleted once every server has unloaded them. Names are never
reused (docs/recipe.md, "The bucket").
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

from ..util.files import atomic_folder

DIR_MODE, FILE_MODE = 0o755, 0o644


def adapter_name(version: int, prefix: str = "policy") -> str:
    """`policy-v7`: the adapter's directory name and its name on the servers."""
    return f"{prefix}-v{version}"


def make_world_readable(path: Path) -> None:
    """chmod 0755 on directories and 0644 on files, recursively (PEFT writes weights 0600)."""
    os.chmod(path, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), DIR_MODE)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), FILE_MODE)


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


class AdapterBucket:
    """Versioned adapters under `root`: `publish`, `mark_unloaded`, automatic retirement.

    `max_staleness`: how many versions a rollout may lag; servers hold `max_staleness + 1`
    versions (one more during a swap), so the bucket keeps the `max_staleness + 2` newest.
    """

    def __init__(self, root: str | os.PathLike, prefix: str = "policy", max_staleness: int = 1):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", prefix):
            raise ValueError(f"prefix must be a plain name, got {prefix!r}")
        self.root = Path(root).absolute()
        self.prefix = prefix
        self.keep = max_staleness + 2
        self.root.mkdir(parents=True, exist_ok=True)
        self.unloaded: set[int] = set()  # versions no server holds any more: safe to delete
        self.deleted: list[int] = []
        self.last_publish: dict = {}
        for leftover in self.root.glob(f".{prefix}-v*.tmp-*"):  # a crash mid-write
            shutil.rmtree(leftover, ignore_errors=True)

    def path(self, version: int) -> Path:
        return self.root / adapter_name(version, self.prefix)

    def versions(self) -> list[int]:
        """Published versions present in the bucket, oldest first (temp dirs are not listed)."""
        pattern = re.compile(rf"{re.escape(self.prefix)}-v(\d+)")
        found = (pattern.fullmatch(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def publish(self, model, version: int) -> Path:
        """Write `model`'s adapter (anything with `save_pretrained`, e.g. a PEFT model) as
        version `version`, atomically; then retire old unloaded versions. Returns its path."""
        final = self.path(version)
        if final.exists():
            raise FileExistsError(f"{final} exists: a version name is never reused")
        start = time.perf_counter()
        with atomic_folder(final) as staging:  # 3. on leaving the block: publish, atomically
            model.save_pretrained(staging)  # 1. write (hidden: readers skip dot-dirs)
            make_world_readable(staging)  # 2. open up
            written = time.perf_counter()
        self.last_publish = {"version": version, "bytes": directory_bytes(final),
                             "write_s": written - start,
                             "publish_s": time.perf_counter() - start}
        self.prune()  # 4. retire
        return final

    def mark_unloaded(self, version: int) -> None:
        """Every server has unloaded `version`: its directory may go once it is old enough."""
        self.unloaded.add(version)

    def prune(self) -> list[int]:
        """Delete versions older than the `keep` newest, but only those marked unloaded."""
        versions = self.versions()
        old = versions[: max(0, len(versions) - self.keep)]
        gone = [v for v in old if v in self.unloaded]
        for version in gone:
            shutil.rmtree(self.path(version), ignore_errors=True)
            self.unloaded.discard(version)
        self.deleted += gone
        return gone


def write_random_adapter(base_model, path: str | Path, rank: int = 1, seed: int = 0,
                         scale: float = 0.1):
    """A rank-`rank` LoRA on every linear layer of a copy of `base_model`, with random A and B,
    saved into `path` (PEFT's files) and returned. PEFT starts B at 0, a no-op: random weights
    make adapters that visibly change the model, for tests, benchmarks and the course's demos of
    wrong weights; different seeds give different adapters."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base_model), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules="all-linear", task_type="CAUSAL_LM"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(path)
    return model.eval()
