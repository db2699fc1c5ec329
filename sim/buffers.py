"""Growable buffers of float64 values that numpy reads without a copy (``np.frombuffer``).

The recorder writes tens of values per event into buffers it converts to numpy in bulk. A ``list`` made
a Python float object per value, which the conversion then read back and freed: about 45 ns a value, a
fifth of the compiled engine loop's instructions on the Azure trace. ``librt.vecs.vec[float]`` (mypy's
runtime library, installed with ``kvsim[native]``) holds the values unboxed: in the compiled build
(sim/native.py) each ``append`` of a float stores 8 bytes, with no object made. Without librt (plain
Python, no mypy), an ``array('d')`` stands in, with the same three calls: ``vec[float](capacity=n)``,
``append(v, x)`` and ``extend(v, xs)``, which return the buffer to use from then on, as librt's do.
"""

from __future__ import annotations

try:
    from librt.vecs import append, extend, vec
except ImportError:  # plain Python without mypy's runtime library
    from array import array

    class _ArrayVec:
        """``vec[float](capacity=n)``: an empty ``array('d')`` (the capacity is a hint)."""

        def __getitem__(self, item):
            return lambda capacity=0: array("d")

    vec = _ArrayVec()  # type: ignore[assignment,misc]

    def append(v, x):  # type: ignore[no-redef]
        v.append(x)
        return v

    def extend(v, xs):  # type: ignore[no-redef]
        v.extend(xs)
        return v

__all__ = ["append", "extend", "vec"]
