"""Writing a benchmark's result: JSON for scripts, a markdown summary beside it for people."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(data: Any, markdown: str, json_path: str | Path | None) -> None:
    """Write ``data`` as JSON to ``json_path`` and ``markdown`` to the same name with ``.md`` (nothing if None)."""
    if json_path is None:
        return
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown + "\n")


def percent(x: float | None) -> str:
    """A share (0-1) as a whole percentage in a table cell; "-" when there is none."""
    return "-" if x is None else f"{x:.0%}"


def save_figure(fig: Any, out: str | Path) -> Path:
    """Lay out a matplotlib figure, write it as a PNG to ``out`` (its folder made) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
