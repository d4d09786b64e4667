"""What every benchmark does with its results: a JSON report and a PNG beside it."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or None (logged) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install -e '.[bench]'): no PNG")
        return None
    return plt


def save(fig: Any, path: Path) -> bool:
    """Lay ``fig`` out, write it to ``path`` and close it; True (a plot was written)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(report: Path, result: dict[str, Any], plot: Callable[[dict[str, Any], Path], bool],
                 progress: Callable[[str], None]) -> None:
    """``result`` as JSON at ``report`` and ``plot`` of it as the PNG beside it."""
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(result, indent=2) + "\n")
    png = report.with_suffix(".png")
    if plot(result, png):
        progress(f"plot written to {png}")
    progress(f"report written to {report}")


def finish(report: Path, result: dict[str, Any], plot: Callable[[dict[str, Any], Path], bool],
           progress: Callable[[str], None], workdir: Path, *, keep_logs: bool) -> None:
    """Write the report and its plot; keep the runs' logs in ``workdir`` when asked or when a run
    failed (``result`` says so), else remove them."""
    write_report(report, result, plot, progress)
    if keep_logs:
        progress(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
