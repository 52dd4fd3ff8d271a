"""Test doubles for code built on mpexec (as ``trio.testing`` is for trio).

- :class:`SimCuPy`: a simulated CUDA device, a NumPy stand-in for the CuPy
  subset the GPU stage uses, strict where a real device is merely
  nondeterministic (deferred stream work, garbage in fresh memory, copies that
  read their source when they run); :func:`simulated` runs GPU ops on a fresh
  one and checks that it recorded no violation. :data:`SEEDS` are the (seed,
  progress) pairs mpexec's own GPU tests run under; :data:`GARBAGE` is the byte
  fresh memory holds. See docs/gpu.md, "How it is checked without a GPU".

Nothing here is imported by mpexec's runtime.
"""

from ._gpusim import GARBAGE, SEEDS, SimCuPy, simulated

__all__ = ["GARBAGE", "SEEDS", "SimCuPy", "simulated"]
