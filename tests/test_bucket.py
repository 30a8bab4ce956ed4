"""Adapter publishing: atomic, readable by other users, retention after unload; job volumes."""

from __future__ import annotations

import stat
import threading
import time

import pytest
from safetensors.torch import load_file

from grpo_lab.bucket.adapters import (
    AdapterBucket,
    adapter_name,
)


class SlowModel:
    """Writes an adapter's two files slowly (or fails half-way), like a big save on a slow disk."""

    def __init__(self, source, delay_s: float = 0.05, fail: bool = False):
        self.source, self.delay_s, self.fail = source, delay_s, fail

    def save_pretrained(self, path):
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            data = (self.source / name).read_bytes()
            with open(path / name, "wb") as out:
                out.write(data[: len(data) // 2])
                out.flush()
                time.sleep(self.delay_s)
                if self.fail:
                    raise OSError("disk full")
                out.write(data[len(data) // 2:])


def test_publish_writes_a_readable_adapter(tmp_path, peft_model):
    bucket = AdapterBucket(tmp_path / "lora", max_staleness=1)
    path = bucket.publish(peft_model, 0)
    assert path == tmp_path / "lora" / "policy-v0" and adapter_name(0) == "policy-v0"
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    for file in path.iterdir():  # PEFT wrote the weights 0600; other users must read them
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name
    assert load_file(path / "adapter_model.safetensors")
    assert bucket.versions() == [0] and bucket.last_publish["bytes"] > 0
    with pytest.raises(FileExistsError):  # a version name is never reused
        bucket.publish(peft_model, 0)


def test_readers_never_see_a_half_written_adapter(tmp_path, peft_model):
    source = AdapterBucket(tmp_path / "source").publish(peft_model, 0)
    bucket = AdapterBucket(tmp_path / "lora", max_staleness=10)
    expected = {f.name: f.read_bytes() for f in source.iterdir()
                if f.name != "README.md"}
    seen, stop = [], threading.Event()

    def reader():  # what a server polling the mount would find
        while not stop.is_set():
            for version in bucket.versions():
                files = {f.name: f.read_bytes() for f in bucket.path(version).iterdir()}
                seen.append(files == expected)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for version in range(5):
            bucket.publish(SlowModel(source), version)
    finally:
        stop.set()
        thread.join()
    assert seen and all(seen)


def test_a_failed_write_publishes_nothing_and_leaves_no_temp_dir(tmp_path, peft_model):
    source = AdapterBucket(tmp_path / "source").publish(peft_model, 0)
    bucket = AdapterBucket(tmp_path / "lora")
    with pytest.raises(OSError, match="disk full"):
        bucket.publish(SlowModel(source, delay_s=0, fail=True), 3)
    assert list((tmp_path / "lora").iterdir()) == []
    (tmp_path / "lora" / ".policy-v4.tmp-crashed").mkdir()  # a trainer killed mid-write
    AdapterBucket(tmp_path / "lora")
    assert list((tmp_path / "lora").iterdir()) == []


def test_retention_keeps_max_staleness_plus_2_and_deletes_only_unloaded(tmp_path, peft_model):
    max_staleness = 2
    bucket = AdapterBucket(tmp_path / "lora", max_staleness=max_staleness)
    for version in range(6):  # nothing unloaded yet: nothing may be deleted
        bucket.publish(peft_model, version)
    assert bucket.versions() == list(range(6))
    bucket.mark_unloaded(0)
    bucket.mark_unloaded(4)  # too recent to go, even though unloaded
    assert bucket.prune() == [0]
    assert bucket.versions() == [1, 2, 3, 4, 5]

    # The sync loop: publish vV, load it, unload v(V - max_staleness - 1); the bucket deletes
    # that directory one sync later and always holds the max_staleness + 2 newest versions.
    bucket = AdapterBucket(tmp_path / "loop", max_staleness=max_staleness)
    for version in range(10):
        bucket.publish(peft_model, version)
        newest = list(range(max(0, version - max_staleness - 1), version + 1))
        assert bucket.versions() == newest
        if version - max_staleness - 1 >= 0:
            bucket.mark_unloaded(version - max_staleness - 1)
    assert bucket.deleted == list(range(10 - max_staleness - 2))
