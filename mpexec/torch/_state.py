"""The loader's resume-state format: what ``state_dict()`` writes and ``load_state_dict()`` takes.

Runs in the caller. A state is a small JSON-able dict (version 2; version 1,
without the epoch's seeds and the batches past its prefix, is still read):
the generators' states when the epoch began, whether it began with new
workers and their base seed, which batches it consumed, and the loader's
batch size and epoch length, checked on load; and, for objects that follow
torchdata's Stateful protocol, the samplers' states as the epoch began and
each worker's dataset (and iterator) state after its last batch consumed
(keys absent when there are none). :func:`validate` reads one
against the facts of a loader, with no loader or process needed (torchdata
keeps its state format in a room of its own the same way).
"""

from __future__ import annotations

import base64
import collections.abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._fetch import state_of

__all__ = [
    "STATE_VERSION",
    "Progress",
    "Resume",
    "generators",
    "load_samplers",
    "own_stream",
    "rng_states",
    "sampler_states",
    "set_rng_states",
    "validate",
]

STATE_VERSION = 2


@dataclass
class Progress:
    """One epoch, as :meth:`DataLoader.state_dict` describes it."""

    rng: dict[str, str]  # the generators when the epoch began (before its draws)
    fresh: bool  # it began with new workers (so it drew a base seed first)
    base_seed: int  # its workers' base seed
    consumed: int = 0  # batches consumed (yielded or failed): a prefix of the epoch's order
    beyond: set[int] = field(default_factory=set)  # consumed past that prefix (in_order=False)
    finished: bool = False
    # The Stateful protocol (torchdata's): the samplers' states when the epoch
    # began; per worker (0: the caller, num_workers=0) the dataset's and its
    # iterator's after the last batch of that worker consumed; an iterable
    # dataset's workers that ended, and the one whose batch comes next.
    samplers: dict[str, Any] = field(default_factory=dict)
    snapshots: dict[int, Any] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    next_worker: int = 0

    def done(self, position: int) -> None:
        """Batch ``position`` of the epoch was consumed."""
        if position != self.consumed:
            self.beyond.add(position)
            return
        self.consumed += 1
        while self.consumed in self.beyond:
            self.beyond.remove(self.consumed)
            self.consumed += 1

    def to_state(self) -> dict[str, Any]:
        """The epoch's part of a state dict."""
        return {
            "rng": self.rng,
            "fresh": self.fresh,
            "base_seed": self.base_seed,
            "batches": self.consumed,
            "beyond": sorted(self.beyond),
            **self.stateful(),
        }

    def stateful(self) -> dict[str, Any]:
        """What the Stateful protocol adds to the state (nothing, without stateful objects)."""
        out: dict[str, Any] = {}
        if self.samplers:
            out["samplers"] = dict(self.samplers)
        if self.snapshots:
            out["workers"] = {str(w): s for w, s in sorted(self.snapshots.items())}
            out["ended"] = sorted(self.ended)
            out["next_worker"] = self.next_worker
        return out


@dataclass(frozen=True)
class Resume:
    """Where a loaded state resumes: what the next epoch restores and skips."""

    rng: dict[str, str]
    fresh: bool
    base_seed: int
    batches: int
    beyond: frozenset[int]
    samplers: dict[str, Any] = field(default_factory=dict)
    snapshots: dict[int, Any] = field(default_factory=dict)  # by worker
    ended: frozenset[int] = frozenset()
    next_worker: int = 0
    num_workers: int | None = None  # the snapshots' workers


def validate(
    state: Any,
    *,
    generators: collections.abc.Mapping[str, torch.Generator],
    batch_size: int | None,
    length: int | None,
) -> Resume:
    """The resume point ``state`` describes, or ValueError saying what is wrong with it.

    ``generators`` (by name, as :func:`generators` gives them), ``batch_size``
    and ``length`` (batches an epoch, None where unknown) are the loader's
    that is to resume: a state taken from a loader built otherwise is refused.
    """

    def bad(what: str) -> ValueError:
        return ValueError(f"load_state_dict(): {what} (pass what DataLoader.state_dict() returned)")

    gens = generators
    if not isinstance(state, collections.abc.Mapping):
        raise bad(f"the state must be a dict, not {type(state).__name__}")
    version = state.get("version")
    if version not in (1, STATE_VERSION):
        raise bad(f"unknown state version {version!r:.50} (this mpexec writes {STATE_VERSION})")
    rng = state.get("rng")
    if not isinstance(rng, collections.abc.Mapping) or set(rng) != set(gens):
        names = sorted(rng) if isinstance(rng, collections.abc.Mapping) else rng
        raise bad(
            f"state['rng'] holds generators {names!r:.100}, this loader has {sorted(gens)}: "
            "build the loader as it was built when the state was taken"
        )
    for name, text in rng.items():
        try:
            raw = base64.b64decode(text, validate=True)
            probe = torch.Generator(device=gens[name].device)
            probe.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except Exception as exc:
            raise bad(f"state['rng'][{name!r}] is not a generator state ({exc})") from None
        if len(raw) != gens[name].get_state().numel():
            raise bad(f"state['rng'][{name!r}] is truncated ({len(raw)} bytes)")
    batches = state.get("batches")
    if type(batches) is not int or batches < 0:
        raise bad(f"state['batches'] must be an int >= 0, not {batches!r:.50}")
    fresh, base_seed, beyond = True, 0, frozenset[int]()
    if version == STATE_VERSION:
        if state.get("batch_size") != batch_size:
            raise bad(
                f"the state was taken with batch_size={state.get('batch_size')!r:.50}, "
                f"this loader has batch_size={batch_size}"
            )
        if state.get("length") != length:
            raise bad(
                f"the state was taken over {state.get('length')!r:.50} batches an epoch, "
                f"this loader has {length}: the same dataset and sampler are needed"
            )
        raw_fresh, raw_seed = state.get("fresh"), state.get("base_seed")
        if type(raw_fresh) is not bool or type(raw_seed) is not int:
            raise bad("state['fresh'] must be a bool and state['base_seed'] an int")
        fresh, base_seed = raw_fresh, raw_seed
        raw_beyond = state.get("beyond")
        if not isinstance(raw_beyond, list) or any(
            type(b) is not int or b <= batches for b in raw_beyond
        ):
            raise bad(f"state['beyond'] must list batch positions past {batches}")
        beyond = frozenset(raw_beyond)
        if length is not None and batches + len(beyond) > length:
            raise bad(f"state['batches'] is {batches}, but an epoch has {length} batches")
        if length is not None and any(b >= length for b in beyond):
            raise bad(f"state['beyond'] names batches past the epoch's {length}")
    samplers, snapshots, ended, next_worker = _stateful(state, bad)
    return Resume(
        dict(rng),
        fresh,
        base_seed,
        batches,
        beyond,
        samplers,
        snapshots,
        ended,
        next_worker,
        state.get("num_workers"),
    )


def _stateful(
    state: collections.abc.Mapping[str, Any], bad: Any
) -> tuple[dict[str, Any], dict[int, Any], frozenset[int], int]:
    """The Stateful protocol's part of a state (absent: nothing to restore)."""
    samplers = state.get("samplers", {})
    if not isinstance(samplers, collections.abc.Mapping) or not set(samplers) <= {
        "sampler",
        "batch_sampler",
    }:
        raise bad("state['samplers'] must map 'sampler' / 'batch_sampler' to their states")
    workers = state.get("workers", {})
    if not isinstance(workers, collections.abc.Mapping):
        raise bad("state['workers'] must map worker ids to their datasets' states")
    try:
        snapshots = {int(w): snap for w, snap in workers.items()}
    except (TypeError, ValueError):
        raise bad("state['workers'] must be keyed by worker ids") from None
    ended, next_worker = state.get("ended", []), state.get("next_worker", 0)
    if not isinstance(ended, list) or any(type(w) is not int for w in ended):
        raise bad("state['ended'] must list worker ids")
    if type(next_worker) is not int or next_worker < 0:
        raise bad("state['next_worker'] must be a worker id")
    return dict(samplers), snapshots, frozenset(ended), next_worker


def sampler_states(loader: Any) -> dict[str, Any]:
    """The states of a loader's Stateful samplers (its sampler, its batch sampler)."""
    out = {}
    for name in ("sampler", "batch_sampler"):
        st = state_of(getattr(loader, name, None))
        if st is not None:
            out[name] = st
    return out


def load_samplers(loader: Any, states: dict[str, Any]) -> None:
    """Give a loader's samplers back what :func:`sampler_states` took."""
    for name, st in states.items():
        getattr(loader, name).load_state_dict(st)


def generators(loader: Any) -> dict[str, torch.Generator]:
    """The generators a loader's epoch draws from, by a stable name."""
    gens = {"loader": loader.generator if loader.generator is not None else torch.default_generator}
    sampler = loader.sampler
    batch_sampler = loader.batch_sampler
    for name, owner in (
        ("sampler", sampler),
        ("batch_sampler", batch_sampler),
        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None)),
    ):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in gens.values()):
            gens[name] = gen
    return gens


def rng_states(loader: Any) -> dict[str, str]:
    """The states of :func:`generators`, as text."""
    return {
        name: base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")
        for name, gen in generators(loader).items()
    }


def set_rng_states(loader: Any, states: dict[str, str]) -> None:
    """Restore what :func:`rng_states` gave."""
    gens = generators(loader)
    for name, text in states.items():
        raw = np.frombuffer(base64.b64decode(text), np.uint8).copy()
        gens[name].set_state(torch.from_numpy(raw))


@contextlib.contextmanager
def own_stream(stream: torch.Generator | None) -> Iterator[None]:
    """Within: torch's global generator draws from ``stream``; after, the program's state again.

    A loader built without ``generator=`` draws its epochs' seeds (and a
    ``RandomSampler``'s) from torch's global generator. Once it resumed from a
    state, those draws come from the loader's own stream instead, restored
    from the state and continued epoch after epoch, and the program's global
    generator is left as the program left it (Lightning and accelerate
    restore theirs themselves). ``None``: no own stream, nothing swapped.
    """
    if stream is None:
        yield
        return
    glob = torch.default_generator
    program = glob.get_state()
    glob.set_state(stream.get_state())
    try:
        yield
    finally:
        stream.set_state(glob.get_state())
        glob.set_state(program)
