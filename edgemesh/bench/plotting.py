"""What every benchmark's plot needs: matplotlib without a screen, or a warning if it is missing."""

from __future__ import annotations

import logging
from types import ModuleType

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
