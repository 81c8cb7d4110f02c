"""What the benchmarks share for their plots."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot drawing to files, or None (with a hint) where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install 'ckpt[bench]')")
        return None
    return plt
