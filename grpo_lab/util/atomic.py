"""Atomic folders: write into a hidden temporary folder, then rename it into place.

A reader (another process, a replica polling the bucket, the next test) sees either no folder or
the whole folder, never a half-written one, because a rename within one file system is atomic.
Used by the tiny-model cache, the bucket's adapter versions and the trainer's checkpoints.
(On a bucket mount the rename is only as atomic as the mount makes it: docs/recipe.md.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (the rename) to disk where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_folder(final: str | os.PathLike, *, keep_existing: bool = False) -> Iterator[Path]:
    """Yield a hidden staging folder beside `final`; rename it to `final` when the block ends.

    If the block raises, the staging folder is deleted and `final` is untouched. With
    `keep_existing`, losing a race (another writer renamed first) keeps theirs and drops ours.
    """
    final = Path(final)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield staging
        try:
            os.rename(staging, final)
        except OSError:
            if not (keep_existing and final.exists()):
                raise
            shutil.rmtree(staging, ignore_errors=True)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
