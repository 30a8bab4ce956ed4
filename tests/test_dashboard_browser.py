"""The live dashboard in a real browser: JupyterLab, headless Chromium, a short synchronous run.

The test starts `jupyter lab` on loopback (a free port, a token, a temporary root holding one
notebook), opens the notebook in Debian's `chromium` driven by playwright, runs all cells and
watches the panel that `Dashboard()` draws while `GRPOTrainer.train(callback=dash)` runs. It
needs the `playwright` package (the `dev` extra) and a system Chromium (`make setup` installs
Debian's `chromium` when it can); without them it skips, unless GRPO_LAB_REQUIRE_BROWSER=1
(CI sets it), where it fails. Playwright's own browser downloads are never used.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from grpo_lab.util.processes import free_port, stop_groups

REPO_ROOT = Path(__file__).resolve().parent.parent
STEPS = 30
"""Training steps in the notebook: long enough to see the panel change, short for CI."""
SYNC_PLOTS = "plots: reward, ratio (pi_theta / pi_old), step time (s); no data for: "
"""The panel's caption (Dashboard.caption) in a synchronous run starts so: the plots that have
data, then the pipeline plots left out."""
SERVER_START_S, PAGE_S, RUN_S = 90, 60, 150
"""Bounds: JupyterLab answering, the notebook open with its kernel idle, the run finished."""


def _missing(reason: str):
    if os.environ.get("GRPO_LAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (GRPO_LAB_REQUIRE_BROWSER=1: run `make setup` first)")
    pytest.skip(f"{reason}; `make setup` installs it where apt-get can (root or sudo)")


def require_browser():
    """(playwright's `sync_playwright`, the system Chromium's path), or skip (fail under
    GRPO_LAB_REQUIRE_BROWSER=1) saying what is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (pip install -e '.[dev]')")
    chromium = find_chromium()
    if chromium is None:
        _missing("no system Chromium (Debian: apt-get install chromium)")
    return sync_playwright, chromium


def find_chromium() -> str | None:
    """The system Chromium: $GRPO_LAB_CHROMIUM, else `chromium` (Debian) or `chromium-browser`."""
    for name in (os.environ.get("GRPO_LAB_CHROMIUM"), "chromium", "chromium-browser"):
        if name and (path := shutil.which(name)):
            return path
    return None


def write_notebook(path: Path, model_dir: Path) -> None:
    """A notebook that shows the live dashboard while the tiny model trains synchronously."""
    setup = (
        "from grpo_lab.train.config import GRPOConfig\n"
        "from grpo_lab.watch.dashboard import Dashboard\n"
        "from grpo_lab.train.trainer import GRPOTrainer\n\n"
        f"config = GRPOConfig(model={str(model_dir)!r}, steps={STEPS}, prompts_per_step=8,\n"
        "                    num_generations=8, eval_every=0, eval_size=16, log_every=10**6,\n"
        "                    log_completions_every=0, num_threads=1)\n"
        "trainer = GRPOTrainer(config)")
    train = (
        "dash = Dashboard(title='a synchronous run, live')\n"
        "records = trainer.train(callback=dash)\n"
        "dash.flush()\n"
        "print('finished', records[-1]['step'])")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(setup),
                                         nbformat.v4.new_code_cell(train)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, path)


def start_jupyter_lab(root: Path, home: Path, port: int, token: str, log) -> subprocess.Popen:
    """`jupyter lab` on 127.0.0.1:port serving `root`, its config, data and workspaces in
    `home` (nothing of the user's is read or written), in a process group of its own."""
    for name in ("config", "data", "runtime", "ipython", "workspaces"):
        (home / name).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"),
           "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "IPYTHONDIR": str(home / "ipython"), "JUPYTER_PLATFORM_DIRS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               f"--LabApp.workspaces_dir={home / 'workspaces'}",
               "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run all cells
               # Offline: no news, no update check, no extension manager asking PyPI.
               "--LabApp.news_url=",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly"]
    if os.geteuid() == 0:  # CI's container runs as root
        command.append("--allow-root")
    return subprocess.Popen(command, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_until_serving(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"jupyter lab exited ({proc.returncode}):\n"
                                 f"{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"jupyter lab did not answer in {SERVER_START_S} s:\n"
                         f"{log_path.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """End jupyter lab and its kernel: its process group, by the id we started it with (the
    kernel too when jupyter lab itself has died)."""
    stop_groups([proc], grace_s=15)


STATUS = ".grpo-lab-dashboard .widget-html-content"  # tqdm's bars are HTML widgets too
IMAGE = ".grpo-lab-dashboard img.widget-image"
PANEL_STEP = f"""() => {{
    const status = document.querySelector('{STATUS}');
    const match = status && status.innerText.trim().match(/^step (\\d+) \\|/);
    return match ? Number(match[1]) : null; }}"""
"""JavaScript: the step number in the panel's status line (`step 12 | reward ...`), or null."""
RUNNING = """() => Array.from(document.querySelectorAll('.jp-InputPrompt'))
    .some(prompt => prompt.innerText.includes('*'))"""
"""JavaScript: whether a cell is executing (its prompt reads `[*]`)."""
STEP_AFTER_WHILE_RUNNING = f"n => ({PANEL_STEP})() > n && ({RUNNING})()"


def watch_the_run(page, url: str, shots: Path) -> dict:
    """Open the notebook, run all cells, and read the panel during and after the run."""
    page.set_default_timeout(PAGE_S * 1000)
    page.goto(url)
    # The notebook is open and its kernel is up and idle.
    page.wait_for_function(
        "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " const k = w && w.sessionContext && w.sessionContext.session"
        " && w.sessionContext.session.kernel; return k && k.status === 'idle'; }")
    # Started, not awaited (the command's promise settles when the last cell has run).
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    seen = {}
    # During the run: the panel is there and shows a step; later, a later step, still running.
    page.wait_for_function(STEP_AFTER_WHILE_RUNNING, arg=0, timeout=RUN_S * 1000)
    seen["first"] = page.evaluate(PANEL_STEP)
    seen["during"] = shots / "during.png"
    page.screenshot(path=str(seen["during"]), full_page=True)
    page.wait_for_function(STEP_AFTER_WHILE_RUNNING, arg=seen["first"], timeout=RUN_S * 1000)
    seen["second"] = page.evaluate(PANEL_STEP)
    # After the run: the cell printed `finished`, the panel shows the last step.
    page.locator(".jp-OutputArea-output", has_text=f"finished {STEPS}").wait_for(
        timeout=RUN_S * 1000)
    seen["after"] = shots / "after.png"
    page.screenshot(path=str(seen["after"]), full_page=True)
    seen["last"] = page.evaluate(PANEL_STEP)
    seen["caption"] = page.locator(f"{STATUS} small").inner_text()
    seen["size"] = page.locator(IMAGE).evaluate("img => [img.naturalWidth, img.naturalHeight]")
    seen["outputs"] = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    return seen


@pytest.mark.slow
def test_live_dashboard_in_jupyterlab_and_headless_chromium(tmp_path, tiny_model_dir):
    sync_playwright, chromium = require_browser()

    root, shots = tmp_path / "root", tmp_path / "screenshots"
    root.mkdir()
    shots.mkdir()
    write_notebook(root / "dashboard.ipynb", tiny_model_dir)
    port, token = free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "jupyter.log"
    with log_path.open("w") as log:
        proc = start_jupyter_lab(root, tmp_path / "jupyter-home", port, token, log)
    try:
        wait_until_serving(proc, f"{base}/api/status?token={token}", log_path)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            try:
                seen = watch_the_run(page, f"{base}/lab/tree/dashboard.ipynb?token={token}", shots)
            except Exception as exc:  # a bounded wait ran out: show what the browser showed
                failed = shots / "failed.png"
                page.screenshot(path=str(failed), full_page=True)
                outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
                raise AssertionError(f"{type(exc).__name__}: {exc}\nscreenshot: {failed}; "
                                     f"jupyter log: {log_path}; cell outputs:\n"
                                     f"{outputs[-3000:]}") from exc
            finally:
                browser.close()
    finally:
        stop(proc)

    where = f"screenshots: {seen['during']} and {seen['after']}; jupyter log: {log_path}"
    first, second, last = seen["first"], seen["second"], seen["last"]
    # Both read while the cell ran (else a bounded wait above ran out and said so).
    assert 0 < first < second <= STEPS, f"the panel did not change during the run; {where}"
    assert last == STEPS, f"the panel shows step {last} at the end, not {STEPS}; {where}"
    print(f"panel during the run: step {first}, then step {second}; at the end: step {last}")
    # Only the plots that have data: three in a synchronous run, in one row (no empty axes).
    assert seen["caption"].startswith(SYNC_PLOTS), f"plots: {seen['caption']!r}; {where}"
    width, height = seen["size"]
    assert width > 0 and height / width < 0.3, f"picture {width}x{height} px; {where}"
    outputs = seen["outputs"]
    assert "FutureWarning" not in outputs, f"{outputs[-2000:]}; {where}"
    assert "acc=nan" not in outputs, f"{outputs[-2000:]}; {where}"
