"""Comparing a restored tree with the saved one, bit for bit."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def same(a: Any, b: Any) -> bool:
    """Same tree structure, and every leaf the same dtype and bytes."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    return str(ta) == str(tb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )
