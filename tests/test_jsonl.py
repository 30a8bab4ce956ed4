"""grpo_lab.util.files: the one reader and the one follower of the jobs' JSONL files."""

import json

import pytest

from grpo_lab.util.files import JsonlTail, read_jsonl


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_read_skips_blank_lines_and_waits_for_an_unfinished_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    _write(path, [{"step": 1}, {"step": 2}], tail='\n{"step": 3, "rew')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"step": 2}')  # complete, no final newline yet
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_read_names_the_file_and_line_of_a_broken_record(tmp_path):
    path = tmp_path / "syncs.jsonl"
    path.write_text('{"version": 1}\nnot json\n{"version": 2}\n')
    with pytest.raises(ValueError, match=r"syncs.jsonl, line 2"):
        read_jsonl(path)


def test_tail_returns_only_new_complete_lines_and_restarts_after_a_rewrite(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []  # no file yet
    _write(path, [{"step": 1}], tail='{"step": 2')
    assert tail.read_new() == [{"step": 1}]
    with path.open("a") as f:
        f.write(', "reward": 0.5}\n')
    assert tail.read_new() == [{"step": 2, "reward": 0.5}]
    assert tail.read_new() == []
    _write(path, [{"step": 1}])  # a resumed run trimmed its file: read again from the start
    assert tail.read_new() == [{"step": 1}]
