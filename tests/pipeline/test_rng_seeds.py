"""An op's ``rng`` is ``SeedSequence(entropy, spawn_key=(epoch, iteration, k))``'s PCG64.

docs/pipeline.md ("Randomness"): ``k`` is the sample's index in the batch + 1
(0 for a batch call). The runner replays SeedSequence's hash on the parts
that change (``_rngseeds.RngSeeds``) instead of building one a call: these
tests pin every word to NumPy's own SeedSequence, and count that a call
builds none.
"""

from __future__ import annotations

import pickle
import random
from typing import Any

import numpy as np
import pytest

from mpexec import _rngseeds
from mpexec._runtime import ChainRunner, Chunk, OpRunner


def _reference(entropy: int, key: tuple[int, ...]) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy, spawn_key=key)))


def _same_words(
    fast: Any, entropy: int, key: tuple[int, ...], last: tuple[int, Any]
) -> np.random.SeedSequence:
    """Assert ``fast`` gives NumPy's SeedSequence's words and pool for ``key``; that one."""
    real = np.random.SeedSequence(entropy, spawn_key=key)
    for n, dtype in [(4, np.uint64), (9, np.uint32), (3, "u8"), last]:
        got, want = fast.generate_state(n, dtype), real.generate_state(n, dtype)
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()
    assert list(fast.pool) == list(real.pool)
    return real


def _draw(x: Any, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return np.concatenate([rng.integers(0, 1 << 62, size=3), rng.standard_normal(2).view(np.int64)])


def _draw_batch(xs: list[Any], rng: np.random.Generator) -> list[Any]:
    return [_draw(x, rng) for x in xs]


ENTROPIES = [0, 1, 7, (1 << 32) - 1, 1 << 32, (1 << 128) - 1, 1 << 200, 0x1234 << 140]


@pytest.mark.parametrize("entropy", ENTROPIES)
def test_every_word_is_seed_sequences(entropy: int) -> None:
    rnd = random.Random(entropy)
    seeds = _rngseeds.RngSeeds(entropy)
    wheres = [(0, 0), (1, 0), (0, 5), ((1 << 40) + 3, (1 << 70) + 1), (2, 3), (0, 5)]
    for where in wheres:
        for k in [0, 1, 2, 63, (1 << 32) - 1, 1 << 32, rnd.getrandbits(90)]:
            fast = seeds.seq(where, k)
            real = _same_words(fast, entropy, (*where, k), last=(0, np.uint32))
            assert fast.spawn_key == real.spawn_key
            assert fast.entropy == real.entropy
    with pytest.raises(ValueError, match="uint32 or uint64"):
        seeds.seq((0, 0), 1).generate_state(2, np.int64)


def test_the_generator_draws_what_seed_sequences_does_and_travels() -> None:
    fast = np.random.Generator(np.random.PCG64(_rngseeds.RngSeeds(99).seq((3, 4), 5)))
    real = _reference(99, (3, 4, 5))
    assert fast.bit_generator.state == real.bit_generator.state

    # Children spawn from the real SeedSequence, as they would have (through the
    # seed sequence: Generator.spawn is NumPy 1.25's).
    def child(g: np.random.Generator) -> np.random.Generator:
        bits = g.bit_generator
        # NumPy < 1.25 has only the private name (the oldest supported is 1.22).
        seq = bits.seed_seq if hasattr(bits, "seed_seq") else bits._seed_seq
        return np.random.Generator(np.random.PCG64(seq.spawn(2)[1]))

    assert child(fast).random() == child(real).random()
    again = pickle.loads(pickle.dumps(fast))
    assert again.integers(0, 1 << 62, 4).tolist() == fast.integers(0, 1 << 62, 4).tolist()


def _chunks() -> list[Chunk]:
    return [
        Chunk(0, 0, 0, 4, 0),
        Chunk(0, 0, 4, 3, 0),
        Chunk(0, 1, 0, 5, 7),
        Chunk(2, 9, 1, 3, 40, rows=(1, 4, 6)),
        Chunk(0, 1, 0, 2, 7),  # a chunk of an iteration seen before
    ]


def _expected(entropy: int, chunk: Chunk) -> list[bytes]:
    rows = chunk.rows or range(chunk.start, chunk.start + chunk.count)
    return [
        _draw(None, _reference(entropy, (chunk.epoch, chunk.iteration, b + 1))).tobytes()
        for b in rows
    ]


def test_a_sample_ops_rng_is_keyed_by_epoch_iteration_and_sample() -> None:
    runner = OpRunner("draw", _draw, "sample", 1, entropy=1234567 << 70)
    for chunk in _chunks():
        inputs = [np.zeros(1)] * chunk.count
        got = runner(chunk, inputs)
        assert [a.tobytes() for a in got.outputs[0]] == _expected(runner.entropy, chunk)


def test_a_chained_ops_rng_is_its_own() -> None:
    first = OpRunner("a", _draw, "sample", 1, entropy=5)
    second = OpRunner("b", _draw, "sample", 1, entropy=6)
    chain = ChainRunner([first, second], [(0,), (0,)])
    for chunk in _chunks():
        got = chain(chunk, [np.zeros(1)] * chunk.count)
        assert [a.tobytes() for a in got.outputs[0]] == _expected(6, chunk)


def test_a_batch_ops_rng_has_k_zero() -> None:
    runner = OpRunner("draw", _draw_batch, "batch", 1, entropy=77)
    got = runner(Chunk(1, 2, 0, 3, 0), np.zeros((3, 1)))
    rng = _reference(77, (1, 2, 0))
    assert [a.tobytes() for a in got.outputs[0]] == [_draw(None, rng).tobytes() for _ in range(3)]


def test_a_call_builds_no_seed_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner hashes the sample's word itself: ~8 us a call less (issue 37)."""
    built = []
    real = np.random.SeedSequence

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(kwargs.get("spawn_key"))
        return real(*args, **kwargs)

    runner = OpRunner("draw", _draw, "sample", 1, entropy=3)
    monkeypatch.setattr(np.random, "SeedSequence", counting)
    got = runner(Chunk(0, 0, 0, 16, 0), [np.zeros(1)] * 16)
    assert got.count == 16
    assert built == []


@pytest.mark.parametrize("entropy", ENTROPIES)
def test_a_chunks_words_hashed_at_once_are_seed_sequences(entropy: int) -> None:
    """``RngSeeds.prepare`` hashes a chunk's calls in arrays: every word NumPy's own."""
    seeds = _rngseeds.RngSeeds(entropy)
    chunks = [
        ((0, 0), range(1, 33)),
        ((3, (1 << 40) + 7), [5, 9, 2, 1 << 31, (1 << 32) - 1, 1 << 32, 3 << 40, 17, 4, 8]),
        ((0, 0), range(40, 48)),  # the same iteration again, other samples
    ]
    for where, ks in chunks:
        seeds.prepare(where, ks)
        for k in ks:
            fast = seeds.seq(where, k)
            _same_words(fast, entropy, (*where, k), last=(4, np.uint32))
            ours = np.random.Generator(np.random.PCG64(fast))
            assert ours.bit_generator.state == _reference(entropy, (*where, k)).bit_generator.state
        other = np.random.SeedSequence(entropy, spawn_key=(9, 9, 1))  # a key not prepared
        want = other.generate_state(4, np.uint64).tobytes()
        assert seeds.seq((9, 9), 1).generate_state(4, np.uint64).tobytes() == want


@pytest.mark.parametrize("chained", [False, True])
def test_a_chunks_rngs_are_hashed_at_once(monkeypatch: pytest.MonkeyPatch, chained: bool) -> None:
    """A chunk of 16 hashes its calls' PCG64 words in one pass, none one by one (issue 37:
    ~4 of a call's ~5 us ``rng``); the draws stay SeedSequence's."""
    one_by_one = []
    real = _rngseeds._generate_constants

    def counting(n: int) -> list[tuple[int, int]]:
        one_by_one.append(n)
        return real(n)

    runner = OpRunner("draw", _draw, "sample", 1, entropy=3)
    chunk = Chunk(0, 2, 0, 16, 0)
    monkeypatch.setattr(_rngseeds, "_generate_constants", counting)
    if chained:
        got = ChainRunner([runner, OpRunner("b", _draw, "sample", 1, 4)], [(0,), (0,)])(
            chunk, [np.zeros(1)] * 16
        )
        want = _expected(4, chunk)
    else:
        got = runner(chunk, [np.zeros(1)] * 16)
        want = _expected(3, chunk)
    assert [a.tobytes() for a in got.outputs[0]] == want
    assert one_by_one == []
