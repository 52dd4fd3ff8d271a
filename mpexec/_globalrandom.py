"""``np.random``'s and ``random``'s global state, as every op's call sees it: reseeded.

Each call of a pipeline op runs as if both global generators were reseeded
from its own seeds first (docs/pipeline.md, "Randomness"). Reseeding costs
~5 us; :class:`GlobalRandom` reseeds them and tells, in a few reads of their
state in place, whether anything drew since (the op runners in ``_runtime``
decide from that where a call may skip it).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from typing import Any

import numpy as np

# The global generators each call reseeds, bound once: ``np.random.seed`` is the
# legacy RandomState's method; ``random.seed`` is reached without its Python
# wrapper (which, for an int, only forwards it and clears ``gauss_next``).
_np_seed = np.random.seed
# NumPy's own RandomState behind np.random.* (no public name): reseeded and watched in place.
_np_inst: Any = np.random.mtrand._rand  # noqa: SLF001 - see above
_np_inst_seed = _np_inst.seed
_py_inst: Any = random.seed.__self__  # type: ignore[attr-defined]
_py_seed: Any = type(_py_inst).__mro__[1].seed  # type: ignore[attr-defined]

_N = 624  # words of Mersenne Twister state, in both generators


def _np_words(state: Any) -> Any:
    """A RandomState's MT19937 ``key[623]`` and ``pos`` as one 64-bit word, read in place.

    ``BitGenerator.ctypes.state_address`` is public; the struct's layout
    (``uint32_t key[624]; int pos``, numpy/random/src/mt19937) is checked on
    a private generator first. None where it cannot be.
    """
    with contextlib.suppress(Exception):
        bg = state._bit_generator  # noqa: SLF001 - RandomState's generator (no public name)
        if type(bg) is np.random.MT19937:
            probe = np.random.RandomState(np.random.MT19937())
            gen = probe._bit_generator  # noqa: SLF001 - as above
            w = ctypes.c_uint64.from_address(gen.ctypes.state_address + 4 * 623)
            probe.seed(5)
            seeded = w.value
            probe.random_sample()  # two words: pos 2, key regenerated
            if seeded >> 32 == _N and w.value >> 32 == 2 and w.value != seeded:
                return ctypes.c_uint64.from_address(bg.ctypes.state_address + 4 * 623)
    return None


def _py_words(inst: Any) -> Any:
    """A ``random.Random``'s ``index`` and ``state[0]`` as one 64-bit word, read in place.

    CPython's ``RandomObject`` is the object header, then ``int index`` and
    ``uint32_t state[624]``; checked on a private instance first.
    """
    with contextlib.suppress(Exception):
        base = type(inst).__mro__[1]
        header = object.__basicsize__
        if base.__basicsize__ >= header + 4 * (_N + 1):
            probe = random.Random()
            w = ctypes.c_uint64.from_address(id(probe) + header)
            probe.seed(5)
            seeded = w.value
            probe.getrandbits(32)  # index 1, state regenerated
            if (
                seeded & 0xFFFFFFFF == _N
                and w.value & 0xFFFFFFFF == 1
                and w.value >> 32 != seeded >> 32
            ):
                return ctypes.c_uint64.from_address(id(inst) + header)
    return None


class GlobalRandom:
    """``np.random``'s and ``random``'s global state, reseeded only where a call reads it.

    Reseeding both costs ~5 us, more than a light op. A call that draws from
    neither cannot tell whether they were reseeded, so a runner may call its
    function on the state left by an earlier reseeding (while it is untouched)
    and check afterwards, in a few word reads, that the call drew nothing. If it
    did, the call is run again on freshly reseeded state and that runner
    reseeds before every call from then on: outputs are those of reseeding
    before every call. Where the state cannot be read in place (another
    Python, another bit generator), every call reseeds.

    Running a call again is bounded (``_runtime.OpRunner._call``): a runner starts
    by reseeding before every call and speculates only after
    ``_runtime._CHEAP_STREAK`` calls in a row drew nothing and each took under
    ``_runtime._CHEAP_SECONDS`` (where reseeding costs as much as the call); a
    chunk of speculative calls that took longer on average sends it back to
    reseeding. So a call
    runs twice at most once per runner and process, and only a function
    whose calls were all cheap and draw-free until then; runners that may
    not repeat (``repeatable=False``) always reseed.
    """

    def __init__(self) -> None:
        self.np = _np_words(_np_inst)
        self.py = _py_words(_py_inst)
        self.bit_generator = getattr(_np_inst, "_bit_generator", None)
        self.watch = self.np is not None and self.py is not None
        self.np_key = self.py_key = -1  # both words right after the last reseeding
        # fresh() was True after the last call and nothing of the caller's ran
        # since (a runner clears it at each chunk): the next check is skipped.
        self.known = False

    def reseed(self, np_seed: int, py_seed: int) -> None:
        self.known = False  # the call about to run may draw
        if self.watch and _np_inst._bit_generator is self.bit_generator:  # noqa: SLF001 - as above
            # An MT19937: what np.random.seed calls for one, without its own check.
            _np_inst_seed(np_seed)
            _py_seed(_py_inst, py_seed)
            _py_inst.gauss_next = None
            self.np_key, self.py_key = self.np.value, self.py.value
            return
        self.watch = False  # np.random.set_bit_generator: not the state watched
        _np_seed(np_seed)
        _py_seed(_py_inst, py_seed)
        _py_inst.gauss_next = None

    def fresh(self) -> bool:
        """Nothing has drawn from either generator since the last :meth:`reseed`.

        A draw moves the position (``pos``, ``index``); drawing a multiple of
        624 words brings it back but regenerates the state words compared too.
        """
        return (
            self.np.value == self.np_key
            and self.py.value == self.py_key
            and _py_inst.gauss_next is None
            and _np_inst._bit_generator is self.bit_generator  # noqa: SLF001 - as above
        )
