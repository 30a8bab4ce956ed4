"""Look at executed notebooks as a learner does: JupyterLab in headless Chromium, a screenshot of
each notebook's first screens.

    .venv/bin/python tools/render_notebooks.py EXECUTED_DIR SCREENSHOT_DIR [--height 6000]

EXECUTED_DIR holds executed notebooks (e.g. `python -m grpo_lab_course 04 --with-solutions
--output-dir D`); the repository's `notebooks/figures/` is copied beside them so the committed
drawings load. Needs playwright and a system Chromium (`make setup`), as
tests/test_dashboard_browser.py does.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_dashboard_browser import require_browser  # noqa: E402

from grpo_lab.util.processes import free_port, stop_groups  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("executed_dir", type=Path)
    parser.add_argument("screenshot_dir", type=Path)
    parser.add_argument("--height", type=int, default=6000, help="pixels of each page shot")
    args = parser.parse_args()
    sync_playwright, chromium = require_browser()
    root = args.executed_dir.resolve()
    figures = root / "figures"
    if figures.is_symlink():
        figures.unlink()
    # a copy: JupyterLab does not serve a link that leaves its root
    shutil.copytree(REPO / "notebooks" / "figures", figures, dirs_exist_ok=True)
    args.screenshot_dir.mkdir(parents=True, exist_ok=True)
    # every cell drawn at once (JupyterLab otherwise draws only the cells in view)
    settings = root / ".lab-settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port, token = free_port(), secrets.token_hex(8)
    lab = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}",
         "--ip=127.0.0.1", "--allow-root", f"--ServerApp.token={token}",
         f"--ServerApp.root_dir={root}",
         f"--LabApp.user_settings_dir={root / '.lab-settings'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(180):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium)
            for notebook in sorted(root.glob("[0-9]*.ipynb")):
                if "with-solutions" in notebook.name:
                    continue
                # a fresh page and workspace each: only this notebook open, in view
                page = browser.new_page(viewport={"width": 1280, "height": args.height})
                page.goto(f"{base}/lab/workspaces/{notebook.stem}/tree/{notebook.name}"
                          f"?reset&token={token}")
                page.wait_for_selector(".jp-Notebook", timeout=120_000)
                page.wait_for_timeout(4000)  # images and math render
                # Simple mode: one notebook, no side panels, as a learner reads it
                shot = args.screenshot_dir / f"{notebook.stem}.png"
                page.screenshot(path=str(shot))
                images = page.locator(".jp-Notebook img").count()
                print(f"{notebook.name}: {images} images in the page; {shot}", flush=True)
                page.close()
            browser.close()
    finally:
        stop_groups([lab], grace_s=10)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
