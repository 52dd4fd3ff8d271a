"""mpexec.torch.DataLoader: torch's DataLoader with one import changed.

Batches are fetched and collated in mpexec's workers, straight into shared
memory; the tensors you get are views of it (shared memory, as torch's:
``is_shared()``). Then: where the time goes (``loader.stats()``), and resuming an
epoch where it stopped, from a JSON-able state. Needs the extra: pip install -e
".[torch]" in a checkout of mpexec (docs/install.md: for a CPU-only torch, install it
first from PyTorch's CPU wheel index).
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    try:
        import torch
        from torch.utils.data import Dataset, get_worker_info

        from mpexec.torch import DataLoader  # was: from torch.utils.data import DataLoader
    except ImportError as exc:
        print(f"skipping the example: {exc}")
        return

    class Squares(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> dict[str, object]:
            info = get_worker_info()  # set in mpexec's workers, as in torch's
            return {
                "x": np.full((32, 32), i * i, np.float32),
                "index": i,
                "worker": info.id if info is not None else -1,
            }

    loader = DataLoader(
        Squares(),
        batch_size=8,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
    )
    for batch in loader:
        print(batch["x"].shape, batch["index"].tolist(), "from worker", batch["worker"][0].item())
        assert batch["x"].is_shared()  # the worker's pages, as torch's batches are
    # The caller's wait per batch against the workers' time per batch: who is the bottleneck.
    print(loader.stats())

    # Resuming: save where an epoch stands, carry on elsewhere.
    it = iter(loader)
    first = [next(it)["index"].tolist() for _ in range(2)]
    state = json.dumps(loader.state_dict())  # small, JSON-able
    rest = [b["index"].tolist() for b in it]
    resumed = DataLoader(
        Squares(), batch_size=8, shuffle=True, num_workers=2, generator=torch.Generator()
    )
    resumed.load_state_dict(json.loads(state))
    again = [b["index"].tolist() for b in resumed]
    assert again == rest, (again, rest)
    print(f"resumed after {len(first)} batches: the same {len(rest)} batches followed")


if __name__ == "__main__":
    main()
    sys.exit(0)
