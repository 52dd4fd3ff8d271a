"""Readers, DALI style: ``fn.readers.file`` reads files in the workers.

A reader is a source of one sample per call, run in the workers like a
per-sample ``external_source`` (so files are read in parallel). Like DALI's
readers it never ends an epoch by itself: it goes round its files for as
long as the pipeline runs, and ``pipe.epoch_size(name)`` says how many
samples a pass holds. The listing, the labels and the sharding are DALI's;
the shuffled orders are deterministic (a function of the seed and the
pass) but not DALI's own.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._graph import DataNode
from ._core import external_source, graph_for

__all__ = ["file"]

#: DALI's default ``file_filters``.
FILE_FILTERS = (
    "*.jpg",
    "*.jpeg",
    "*.png",
    "*.bmp",
    "*.tif",
    "*.tiff",
    "*.pnm",
    "*.ppm",
    "*.pgm",
    "*.pbm",
    "*.jp2",
    "*.webp",
    "*.flac",
    "*.ogg",
    "*.wav",
)


def file(
    *,
    file_root: str | os.PathLike[str] | None = None,
    files: Sequence[str] | None = None,
    labels: Sequence[int] | None = None,
    file_list: str | os.PathLike[str] | None = None,
    file_filters: str | Sequence[str] = FILE_FILTERS,
    dir_filters: str | Sequence[str] | None = None,
    case_sensitive_filter: bool = False,
    random_shuffle: bool = False,
    shuffle_after_epoch: bool = False,
    shuffle_after_epoch_seed: int | None = None,
    seed: int = -1,
    shard_id: int = 0,
    num_shards: int = 1,
    stick_to_shard: bool = False,
    pad_last_batch: bool = False,
    name: str | None = None,
    device: str | None = None,
    preserve: bool = False,
    bytes_per_sample_hint: int | Sequence[int] = 0,
    dont_use_mmap: bool = False,
    initial_fill: int = 1024,
    lazy_init: bool = False,
    prefetch_queue_depth: int = 1,
    read_ahead: bool = False,
    skip_cached_images: bool = False,
    tensor_init_bytes: int = 1048576,
) -> list[DataNode]:
    """Files' bytes and their labels (DALI's ``fn.readers.file``): ``[data, label]``.

    ``data``: one uint8 array per file, its whole contents; ``label``: an
    int32 array of shape ``(1,)``. The files are, as in DALI:

    - ``file_root`` alone: the files in each sub-directory of ``file_root``
      (sorted, not recursing further) that match ``file_filters``
      (case-insensitively unless ``case_sensitive_filter``); each
      sub-directory, in sorted order, is one label: 0, 1, ...
      ``dir_filters`` keeps only the sub-directories that match one.
    - ``files`` (relative to ``file_root`` if given) with ``labels``
      (default: 0, 1, ... in order); or ``file_list``, a text file of
      ``name label`` lines (names relative to ``file_root``, or to the
      list's directory).

    ``num_shards``/``shard_id``: shard ``i`` starts at file
    ``floor(N*i/num_shards)``; it reads on into the next shard's files after
    its own (DALI's default), or, with ``stick_to_shard=True``, goes round its
    own. ``pad_last_batch=True`` repeats a shard's last file up to whole
    batches of ``ceil(N/num_shards)`` samples, and a pass holds
    ``ceil(N/num_shards) * num_shards`` samples (``pipe.epoch_size(name)``),
    as in DALI.
    ``random_shuffle`` shuffles the order of each pass over the shard,
    ``shuffle_after_epoch`` the whole list before each pass (the same on every
    shard, so shards stay disjoint); both from ``seed`` (default: derived
    from the pipeline's) and the pass number. DALI's performance arguments
    (``initial_fill``, ``read_ahead``, ``dont_use_mmap``, ...) are accepted
    and have no effect here.
    """
    del bytes_per_sample_hint, dont_use_mmap, initial_fill, lazy_init, prefetch_queue_depth
    del read_ahead, skip_cached_images, tensor_init_bytes, preserve
    graph = graph_for("readers.file")
    name_ = name if name is not None else graph.unique_name("file_reader")
    what = f"fn.readers.file '{name_}'"
    if device not in (None, "cpu"):
        raise ValueError(f"{what}: readers run on the CPU (device='cpu'), not {device!r}")
    paths, label_list = _listing(
        what, file_root, files, labels, file_list, file_filters, dir_filters, case_sensitive_filter
    )
    for arg, value in (("num_shards", num_shards), ("shard_id", shard_id)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{what}: {arg} must be an int, not {value!r}")
    if num_shards < 1:
        raise ValueError(f"{what}: num_shards must be an int >= 1, not {num_shards!r}")
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"{what}: shard_id must be in [0, {num_shards}), not {shard_id!r}")
    if len(paths) < num_shards:
        raise ValueError(f"{what}: {len(paths)} files cannot make {num_shards} shards")
    if shuffle_after_epoch and (random_shuffle or stick_to_shard):
        raise ValueError(
            f"{what}: shuffle_after_epoch cannot be combined with random_shuffle or "
            "stick_to_shard (as in DALI)"
        )
    if seed == -1:
        base = graph.seed if graph.seed is not None else 0
        seed = int(np.random.SeedSequence([base, len(graph.ops)]).generate_state(1)[0])
    if shuffle_after_epoch_seed is not None:
        seed = shuffle_after_epoch_seed
    batch_size = graph.batch_size or 1
    reader = FileReader(
        paths,
        label_list,
        shard_id=shard_id,
        num_shards=num_shards,
        stick_to_shard=stick_to_shard,
        pad_last_batch=pad_last_batch,
        random_shuffle=random_shuffle,
        shuffle_after_epoch=shuffle_after_epoch,
        seed=int(seed),
        batch_size=batch_size,
    )
    out: list[DataNode] = external_source(reader, num_outputs=2, batch=False, name=name_)
    return out


class FileReader:
    """The source behind ``fn.readers.file``: sample ``k`` of the stream -> (bytes, label).

    A plain function of ``k`` (the sample's index in the pipeline's epoch),
    so any worker computes any sample and the stream is deterministic.
    """

    def __init__(
        self,
        paths: list[str],
        labels: list[int],
        *,
        shard_id: int,
        num_shards: int,
        stick_to_shard: bool,
        pad_last_batch: bool,
        random_shuffle: bool,
        shuffle_after_epoch: bool,
        seed: int,
        batch_size: int = 1,
    ) -> None:
        self.paths = paths
        self.labels = np.asarray(labels, dtype=np.int32)
        n = len(paths)
        self.bounds = [n * i // num_shards for i in range(num_shards + 1)]
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.stick_to_shard = stick_to_shard
        self.per_shard = -(-n // num_shards)
        # With pad_last_batch: samples a shard gives per pass, in whole batches.
        self.pad = -(-self.per_shard // batch_size) * batch_size if pad_last_batch else 0
        self.random_shuffle = random_shuffle
        self.shuffle_after_epoch = shuffle_after_epoch
        self.seed = seed

    @property
    def epoch_size(self) -> int:
        """Samples in one pass over every shard (DALI's ``epoch_size``, padded)."""
        return self.per_shard * self.num_shards if self.pad else len(self.paths)

    def _shard(self, s: int) -> list[int]:
        """The file indices of shard ``s``, padded with its last one where asked."""
        a, b = self.bounds[s], self.bounds[s + 1]
        idx = list(range(a, b))
        return idx + [b - 1] * (self.pad - len(idx)) if self.pad else idx

    def index(self, k: int) -> int:
        """The file read as sample ``k`` of the stream."""
        if self.stick_to_shard:
            order = self._shard(self.shard_id)
            p, pos = divmod(k, len(order))
            if self.random_shuffle:
                pos = int(self._permutation(p, len(order))[pos])
            return order[pos]
        if self.pad:
            # Shard after shard, each padded: the stream of this shard's reader.
            per = self.pad
            p, pos = divmod(k, per)
            s = (self.shard_id + p) % self.num_shards
            order = self._shard(s)
            if self.random_shuffle:
                pos = int(self._permutation(p, per)[pos])
            return order[pos]
        n = len(self.paths)
        p, pos = divmod(k, n)
        if self.random_shuffle:
            pos = int(self._permutation(p, n)[pos])
        i = (self.bounds[self.shard_id] + pos) % n
        if self.shuffle_after_epoch:
            return int(self._permutation(p, n)[i])
        return i

    def _permutation(self, p: int, n: int) -> np.ndarray[Any, Any]:
        # Shuffles of different passes and shards are independent draws.
        shard = 0 if self.shuffle_after_epoch else self.shard_id
        return np.random.default_rng([self.seed, shard, p]).permutation(n)

    def __call__(self, info: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        i = self.index(int(info.idx_in_epoch))
        data = np.fromfile(self.paths[i], dtype=np.uint8)
        return data, self.labels[i : i + 1].copy()

    def __repr__(self) -> str:
        return f"FileReader({len(self.paths)} files, shard {self.shard_id}/{self.num_shards})"


def _listing(
    what: str,
    file_root: Any,
    files: Sequence[str] | None,
    labels: Sequence[int] | None,
    file_list: Any,
    file_filters: str | Sequence[str],
    dir_filters: str | Sequence[str] | None,
    case_sensitive: bool,
) -> tuple[list[str], list[int]]:
    """The files to read and their labels, as DALI lists them."""
    if files is not None and file_list is not None:
        raise ValueError(f"{what}: give files= or file_list=, not both")
    root = os.fspath(file_root) if file_root is not None else None
    if files is not None:
        names = [os.fspath(f) for f in files]
        if labels is None:
            label_list = list(range(len(names)))
        elif len(labels) != len(names):
            raise ValueError(f"{what}: {len(labels)} labels given for {len(names)} files")
        else:
            label_list = [int(v) for v in labels]
        paths = [os.path.join(root, f) if root else f for f in names]
    elif file_list is not None:
        list_path = os.fspath(file_list)
        base = root if root else os.path.dirname(list_path)
        paths, label_list = [], []
        # DALI's format: a path and a label, split at the last run of whitespace (a
        # space or a tab); a UTF-8 byte-order mark before the first line is dropped.
        with open(list_path, encoding="utf-8-sig") as f:
            for number, raw in enumerate(f, 1):
                line = raw.strip()
                if not line:
                    continue
                parts = line.rsplit(maxsplit=1)
                entry, label = (parts[0], parts[1]) if len(parts) == 2 else (line, "0")
                try:
                    label_list.append(int(label))
                except ValueError:
                    raise ValueError(
                        f"{what}: file_list {list_path!r}, line {number}: the label "
                        f"{label!r} is not an integer (each line is `path label`)"
                    ) from None
                paths.append(os.path.join(base, entry))
    elif root is not None:
        if labels is not None:
            raise ValueError(
                f"{what}: labels= goes with files=; under file_root the labels are "
                "the sub-directories"
            )
        paths, label_list = _walk(what, root, file_filters, dir_filters, case_sensitive)
    else:
        raise ValueError(f"{what}: give file_root=, files= or file_list=")
    if not paths:
        raise ValueError(f"{what}: no files found (file_root={root!r})")
    return paths, label_list


def _walk(
    what: str,
    root: str,
    file_filters: str | Sequence[str],
    dir_filters: str | Sequence[str] | None,
    case_sensitive: bool,
) -> tuple[list[str], list[int]]:
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{what}: file_root {root!r} is not a directory")
    patterns = [file_filters] if isinstance(file_filters, str) else list(file_filters)
    dirs_wanted = [dir_filters] if isinstance(dir_filters, str) else dir_filters

    def match(name: str, pats: Sequence[str]) -> bool:
        if case_sensitive:
            return any(fnmatch.fnmatchcase(name, p) for p in pats)
        return any(fnmatch.fnmatchcase(name.lower(), p.lower()) for p in pats)

    subdirs = sorted(e.name for e in os.scandir(root) if _is(e, "dir"))
    if dirs_wanted is not None:
        subdirs = [d for d in subdirs if match(d, dirs_wanted)]
    paths: list[str] = []
    labels: list[int] = []
    for label, d in enumerate(subdirs):
        names = sorted(
            e.name
            for e in os.scandir(os.path.join(root, d))
            if _is(e, "file") and match(e.name, patterns)
        )
        paths += [os.path.join(root, d, n) for n in names]
        labels += [label] * len(names)
    return paths, labels


def _is(entry: os.DirEntry[str], kind: str) -> bool:
    """Whether a listed entry is a directory (``kind="dir"``) or a file; False for an
    entry that cannot be followed (a looping or broken link), which is skipped, as
    DALI skips it, rather than failing the whole listing."""
    try:
        return entry.is_dir() if kind == "dir" else entry.is_file()
    except OSError:
        return False
