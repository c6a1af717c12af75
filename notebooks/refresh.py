"""Re-execute the tutorials in place and strip what nbval does not check: `python notebooks/refresh.py [NAMES]`.

Saved widget state and the outputs of widgets and big figures are dropped (they only render live, and a plotly
figure weighs hundreds of kilobytes); text outputs stay, since nbval compares them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent
HEAVY = ("application/vnd.jupyter.widget-view+json", "application/vnd.plotly.v1+json", "text/html")


def refresh(path: Path) -> None:
    book = nbformat.read(path, as_version=4)
    NotebookClient(book, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    book.metadata.pop("widgets", None)
    for cell in book.cells:
        if cell.cell_type != "code":
            continue
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and any(k in data for k in HEAVY):
                out["data"] = {"text/plain": data.get("text/plain", "<widget or figure: run the notebook to see it>")}
    nbformat.write(book, path)
    print(f"{path.name}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in HERE.glob("0*.ipynb"))
    for name in names:
        refresh(HERE / name)
