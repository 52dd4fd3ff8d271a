"""mpexec.torch.DataLoader in processes torch itself spawns: DDP's ``mp.spawn``.

``torch.multiprocessing.spawn`` (and Lightning's ``ddp_spawn``) start each rank
with the spawn method, which runs the user's script as multiprocessing's
``__mp_main__``: a dataset class defined in that script must still reach the
loader's workers, with every start method.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.conftest import START_METHODS

T = 240  # seconds: two ranks, each starting a pool, on a loaded host

pytestmark = pytest.mark.usefixtures("no_leaks")

DDP_SCRIPT = """\
import os
import sys

import torch.multiprocessing as tmp
from torch.utils.data import Dataset

from mpexec.torch import DataLoader


class Squares(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i * i


def collate(batch):
    return [int(x) for x in batch]


def run(rank, method):
    ctx = None if method == "default" else method
    dl = DataLoader(
        Squares(), batch_size=4, num_workers=2, multiprocessing_context=ctx, collate_fn=collate
    )
    # One write of the whole line: the two ranks share the pipe, and print's pieces
    # (each its own write in a rank's unbuffered stdout) interleaved under load.
    os.write(1, f"RANK {rank} {[b for b in dl]}\\n".encode())


if __name__ == "__main__":
    tmp.spawn(run, args=(sys.argv[1],), nprocs=2, join=True)
"""


@pytest.mark.parametrize("method", ["default", *START_METHODS])
def test_loader_over_a_main_script_class_in_spawned_ranks(method: str, tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "ddp.py", method],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"RANK {rank} [[0, 1, 4, 9], [16, 25, 36, 49]]" in proc.stdout, proc.stderr
