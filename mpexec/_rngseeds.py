"""An op's per-call ``rng``: NumPy's SeedSequence hash, replayed on what changes.

A function with an ``rng`` keyword gets, for call ``k`` of an iteration (the
sample's index in the batch + 1; 0 for a batch call), the PCG64 generator of
``SeedSequence(entropy, spawn_key=(epoch, iteration, k))`` (docs/pipeline.md,
"Randomness"). Building that SeedSequence and letting PCG64 hash it cost ~8 us
a call, more than a light op; here the op's entropy is mixed into the pool
once, the epoch and iteration once per chunk, and a call mixes its one word
and hashes the pool: ~4 us, the same words bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# SeedSequence's constants (numpy/random/bit_generator.pyx).
_M32 = 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_POOL = 4  # SeedSequence's default pool_size


def _uint32_words(n: int) -> list[int]:
    """``SeedSequence``'s words of a non-negative int: little-endian 32-bit, [0] for 0."""
    words = [n & _M32]
    n >>= 32
    while n:
        words.append(n & _M32)
        n >>= 32
    return words


def _absorb(pool: list[int], hc: int, words: Sequence[int]) -> int:
    """Mix entropy ``words`` (those past the pool's four) into ``pool``; the new hash constant."""
    for w in words:
        for i in range(_POOL):
            v = w ^ hc
            hc = (hc * _MULT_A) & _M32
            v = (v * hc) & _M32
            v ^= v >> 16
            r = (_MIX_L * pool[i] - _MIX_R * v) & _M32
            pool[i] = r ^ (r >> 16)
    return hc


#: Chunks shorter than this hash their calls' seed sequences one by one (RngSeeds.prepare).
PREPARE_MIN = 8

_U32, _U16, _U32_SHIFT = np.uint64(_M32), np.uint64(16), np.uint64(32)
_U_MIX_R = np.uint64(_MIX_R)

_GENERATE: list[tuple[int, int]] = []  # generate_state's hash constant, before and after each word


def _generate_constants(n: int) -> list[tuple[int, int]]:
    """The hash constant before and after each of ``generate_state``'s first ``n`` words.

    They do not depend on the pool: computed once.
    """
    while len(_GENERATE) < n:
        before = _GENERATE[-1][1] if _GENERATE else _INIT_B
        _GENERATE.append((before, (before * _MULT_B) & _M32))
    return _GENERATE[:n]


# generate_state(4, np.uint64)'s eight 32-bit words: the pool word each reads, its constants.
_WORD_POOL = [i % _POOL for i in range(8)]
_WORD_BEFORE = np.array([b for b, _ in _generate_constants(8)], dtype=np.uint64)
_WORD_AFTER = np.array([a for _, a in _generate_constants(8)], dtype=np.uint64)


class RngSeeds:
    """An op's ``SeedSequence(entropy, spawn_key=(epoch, iteration, k))``, cheaply.

    Building the SeedSequence and letting ``PCG64`` hash it cost ~8 us a call;
    the entropy's part of the pool is mixed once per op, the epoch's and the
    iteration's once per chunk, so a call mixes one word (``k``) and hashes
    the pool: the same words, bit for bit (tests compare every step).
    """

    def __init__(self, entropy: int) -> None:
        run = _uint32_words(entropy)
        run += [0] * (_POOL - len(run))  # a spawn key is never empty: padded
        pool = [0] * _POOL
        hc = _INIT_A
        for i in range(_POOL):
            v = run[i] ^ hc
            hc = (hc * _MULT_A) & _M32
            v = (v * hc) & _M32
            pool[i] = v ^ (v >> 16)
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    v = pool[src] ^ hc
                    hc = (hc * _MULT_A) & _M32
                    v = (v * hc) & _M32
                    v ^= v >> 16
                    r = (_MIX_L * pool[dst] - _MIX_R * v) & _M32
                    pool[dst] = r ^ (r >> 16)
        self.entropy = entropy
        self.hc = _absorb(pool, hc, run[_POOL:])
        self.pool = pool
        self.where: tuple[int, int] | None = None
        self.where_pool = pool
        self.where_hc = self.hc
        # What prepare() hashed last: its (epoch, iteration) and, per k, the pool and PCG64
        # words (one attribute, replaced whole).
        self.ready: tuple[tuple[int, int] | None, dict[int, tuple[list[int], Any]]] = (None, {})

    def _at(self, where: tuple[int, int]) -> None:
        """Mix the epoch and the iteration of ``where`` into the pool (once per chunk)."""
        if where != self.where:
            pool = list(self.pool)
            hc = _absorb(pool, self.hc, _uint32_words(where[0]) + _uint32_words(where[1]))
            self.where, self.where_pool, self.where_hc = where, pool, hc

    def prepare(self, where: tuple[int, int], ks: Sequence[int]) -> None:
        """Hash the seed sequences of a chunk's calls ``(*where, k)`` at once, for :meth:`seq`.

        A call's own hash is ~70 Python integer operations, most of a call's
        ``rng``; over a chunk it is ~20 array operations whatever its length (32
        calls with their PCG64s: 74 k -> 28 k instructions a call). Each call's
        pool and its PCG64 words (``generate_state(4, np.uint64)``) are kept until
        the next ``prepare``; :meth:`seq` hands them out. Chunks under
        :data:`PREPARE_MIN` calls (where the arrays cost more than they save), and
        keys past 32 bits, are left to :meth:`seq`'s own hash.
        """
        if len(ks) < PREPARE_MIN:
            return
        ks = [k for k in ks if 0 <= k <= _M32]
        self._at(where)
        hc = self.where_hc
        before, after = [], []
        for _ in range(_POOL):  # the hash constants of k's four mixes: one set a chunk
            before.append(hc)
            hc = (hc * _MULT_A) & _M32
            after.append(hc)
        mixed = np.array([(_MIX_L * p) & _M32 for p in self.where_pool], dtype=np.uint64)
        key = np.array(ks, dtype=np.uint64)[:, None]
        # Every product is of two 32-bit values: none wraps 64 bits, and a wrapped
        # difference is right modulo 2**32.
        v = ((key ^ np.array(before, dtype=np.uint64)) * np.array(after, dtype=np.uint64)) & _U32
        v ^= v >> _U16
        r = (mixed - _U_MIX_R * v) & _U32
        pool = r ^ (r >> _U16)
        w = ((pool[:, _WORD_POOL] ^ _WORD_BEFORE) * _WORD_AFTER) & _U32
        w ^= w >> _U16
        words = w[:, 0::2] | (w[:, 1::2] << _U32_SHIFT)
        self.ready = (where, dict(zip(ks, zip(pool.tolist(), words, strict=True), strict=True)))

    def seq(self, where: tuple[int, int], k: int) -> SeedState:
        """The seed sequence of spawn key ``(*where, k)``."""
        ready_where, ready = self.ready
        if where == ready_where:
            got = ready.get(k)
            if got is not None:
                return SeedState(self.entropy, (*where, k), got[0], got[1])
        self._at(where)
        if k > _M32:
            pool = list(self.where_pool)
            _absorb(pool, self.where_hc, _uint32_words(k))
            return SeedState(self.entropy, (*where, k), pool)
        # _absorb of the one word k, unrolled: its hash constants follow the chunk's.
        pool = []
        hc = self.where_hc
        for p in self.where_pool:
            v = k ^ hc
            hc = (hc * _MULT_A) & _M32
            v = (v * hc) & _M32
            r = (_MIX_L * p - _MIX_R * (v ^ (v >> 16))) & _M32
            pool.append(r ^ (r >> 16))
        return SeedState(self.entropy, (*where, k), pool)


class SeedState:
    """A mixed pool standing for ``SeedSequence(entropy, spawn_key=key)``.

    ``generate_state`` is SeedSequence's own; anything else (``spawn``,
    ``pool``, ...) is answered by the real SeedSequence, made on first use.
    """

    def __init__(
        self,
        entropy: int,
        key: tuple[int, ...],
        pool: list[int],
        words: np.ndarray[Any, Any] | None = None,
    ) -> None:
        self._entropy, self._key, self._pool = entropy, key, pool
        self._words = words  # generate_state(4, np.uint64), where already hashed (PCG64's)
        self._real: Any = None

    def generate_state(self, n_words: int, dtype: Any = np.uint32) -> np.ndarray[Any, Any]:
        """SeedSequence.generate_state: ``n_words`` of ``dtype`` (uint32 or uint64)."""
        if n_words == 4 and dtype is np.uint64 and self._words is not None:
            ready: np.ndarray[Any, Any] = self._words.copy()  # PCG64's, hashed with its chunk's
            return ready
        wide = dtype is np.uint64 or np.dtype(dtype) == np.uint64
        if not wide and np.dtype(dtype) != np.uint32:
            raise ValueError("only support uint32 or uint64")
        pool, words = self._pool, []
        for i, (before, after) in enumerate(_generate_constants(2 * n_words if wide else n_words)):
            v = ((pool[i & 3] ^ before) * after) & _M32
            words.append(v ^ (v >> 16))
        if wide:
            words = [lo | hi << 32 for lo, hi in zip(words[::2], words[1::2], strict=True)]
        return np.array(words, dtype=np.uint64 if wide else np.uint32)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_real", "_entropy", "_key", "_pool", "_words"):
            raise AttributeError(name)
        if self._real is None:
            self._real = np.random.SeedSequence(self._entropy, spawn_key=self._key)
        return getattr(self._real, name)

    def spawn(self, n_children: int) -> list[np.random.SeedSequence]:
        """SeedSequence.spawn (of the real one: its children count is kept)."""
        return self.__getattr__("spawn")(n_children)  # type: ignore[no-any-return]


np.random.bit_generator.ISpawnableSeedSequence.register(SeedState)
