"""Files a run writes: atomic folders, and JSON Lines appended and read back.

Atomic folders: write into a hidden temporary folder, then rename it into place.

A reader (another process, a replica polling the bucket, the next test) sees either no folder or
the whole folder, never a half-written one, because a rename within one file system is atomic.
Used by the tiny-model cache, the bucket's adapter versions and the trainer's checkpoints.
(On a bucket mount the rename is only as atomic as the mount makes it: docs/recipe.md.)
"""

from __future__ import annotations

import json
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


# ------------------------------------------------------------ JSON lines
# JSON Lines, one record per line, as the trainers write `metrics.jsonl`, `syncs.jsonl` and
# `completions.jsonl`: read a whole file, or follow one while a job appends to it.
#
# A file being appended to may end in a half-written line; a resumed trainer rewrites its metrics
# file shorter (it trims the steps it logs again). Both readers cope with each.


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> None:
    """One JSON object per line, keys in their order (the same rows give the same bytes)."""
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every record of a JSONL file ([] when it does not exist). Blank lines are skipped and an
    unfinished last line (no newline yet: a writer is mid-line) is left for the next read; a
    broken line anywhere else raises ValueError naming the file and the line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    unfinished = lines.pop()  # "" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: not a JSON record ({exc})") from None
    if unfinished.strip():
        try:
            records.append(json.loads(unfinished))  # complete, only the newline is missing
        except ValueError:
            pass
    return records


class JsonlTail:
    """The records appended to a JSONL file since the last `read_new()`, read from an offset.

    Only complete lines are returned (an unfinished one waits for its newline). A file that got
    shorter was rewritten: reading starts over from its beginning, so records may come again
    (a resumed run's steps); a line that does not parse there is skipped, the next read resyncs.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.offset = 0
        self._partial = b""

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        if self.path.stat().st_size < self.offset:  # rewritten shorter
            self.offset, self._partial = 0, b""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        self.offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        records = []
        for line in lines:
            try:
                record = json.loads(line) if line.strip() else None
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
        return records
