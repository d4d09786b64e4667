"""Plain helper functions shared by more than one test module, grouped under a comment header per topic.

Fixtures belong in ``conftest.py``; this module holds ordinary functions (``from helpers import ...``).
"""

from __future__ import annotations

import numpy as np

# --- data sets ------------------------------------------------------------------


def label_distribution(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """The fraction of ``labels`` in each of ``num_classes`` classes."""
    return np.bincount(labels, minlength=num_classes) / labels.shape[0]
