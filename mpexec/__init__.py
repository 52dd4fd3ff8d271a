"""mpexec: GIL-free, zero-copy ``python_function`` ops for data pipelines.

User Python functions over NumPy arrays run in worker processes, fed through
shared-memory ring buffers (the ``shm`` package) so that no array is pickled or
copied on the way; GPU ops run in the main process on CUDA streams.

Run ``python -m mpexec doctor`` to see what this machine offers.
"""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
