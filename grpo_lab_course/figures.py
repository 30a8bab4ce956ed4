"""The course's figures: every caption has an image above it, in the executed notebook and in its
HTML.

A figure is captioned in markdown by a paragraph that starts `**Figure <notebook>.<k>:**`
(`**Figure 4.1:** The buffer ...`, `**Figure 1b.2:** ...`). Its image is either in the same
markdown cell (`![...](figures/....svg)`: a committed drawing under `notebooks/figures/`) or an
output of the code cell just above (a plot drawn from the run's own records).
"""

from __future__ import annotations

import re
from pathlib import Path

CAPTION = re.compile(r"^\*\*Figure (\d+b?)\.(\d+):\*\*", re.MULTILINE)
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)|<img [^>]*src=\"([^\"]+)\"")
_IMAGE_TYPES = ("image/png", "image/svg+xml", "image/jpeg")


def _cell_images(cell) -> int:
    if cell.cell_type != "code":
        return 0
    return sum(1 for out in cell.get("outputs", [])
               if any(kind in out.get("data", {}) for kind in _IMAGE_TYPES))


def figure_captions(notebook) -> list[tuple[str, int]]:
    """`[("4.1", cell index), ...]`: the captions of a notebook (an `nbformat` node), in order."""
    found = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "markdown":
            found += [(f"{m.group(1)}.{m.group(2)}", index) for m in CAPTION.finditer(cell.source)]
    return found


def figures_without_image(notebook, notebook_dir: Path) -> list[str]:
    """The captions of an executed notebook with no image: no markdown image in the caption's cell
    whose file exists under `notebook_dir`, and no image output in the code cell above it."""
    missing = []
    for figure, index in figure_captions(notebook):
        cell = notebook.cells[index]
        links = [a or b for a, b in _MARKDOWN_IMAGE.findall(cell.source)]
        linked = any((notebook_dir / link).is_file() for link in links if "://" not in link)
        above = _cell_images(notebook.cells[index - 1]) if index > 0 else 0
        if not (linked or above):
            missing.append(figure)
    return missing


def html_images(notebook) -> int:
    """How many images the nbconvert HTML of an executed notebook holds (inline plots and linked
    drawings): what a reader of the rendered page sees."""
    from nbconvert import HTMLExporter

    html, _ = HTMLExporter().from_notebook_node(notebook)
    return len(re.findall(r"<img\b", html)) + len(re.findall(r"<svg\b[^>]*xmlns", html))
