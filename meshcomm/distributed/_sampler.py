"""``DistributedSampler``: torch's index sequences, without torch.

Each rank iterates over its share of a dataset's indices: shuffled with a seed every rank
shares (``seed + epoch``), padded (or cut, with ``drop_last``) to a multiple of the number
of replicas, then every ``num_replicas``-th index from ``rank``. The shuffle reproduces
``torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))`` exactly: torch's
CPU generator is MT19937 seeded with the low 32 bits of the seed, and its ``randperm`` for
``n`` below 2**32 / 20 swaps element ``i`` with ``i + (draw % (n - i))`` for each 32-bit
draw. Larger datasets raise, rather than give a different order.

Works with anything that has ``len()``; hand it to a torch ``DataLoader(sampler=...)``.

Example:
    >>> sampler = DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=False)
    >>> list(sampler), len(sampler)
    ([1, 3, 5, 7, 9], 5)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np

__all__ = ["DistributedSampler", "torch_randperm"]

# torch's randperm switches to 64-bit draws at this size; meshcomm reproduces only the 32-bit one.
_SMALL_N = (2**32 - 1) // 20


def torch_randperm(n: int, seed: int) -> list[int]:
    """Return ``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()``.

    Raises:
        ValueError: ``n`` is negative or too large to reproduce.

    Example:
        >>> torch_randperm(5, 0)
        [4, 0, 1, 3, 2]
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if n >= _SMALL_N:
        raise ValueError(f"datasets of {n} items or more are not supported (torch draws 64 bits)")
    # Legacy seeding of numpy's MT19937 is the reference init_genrand, as torch's.
    draws = np.random.RandomState(seed & 0xFFFFFFFF).randint(
        0, 2**32, size=max(n - 1, 0), dtype=np.uint64
    )
    perm = list(range(n))
    for i, draw in enumerate(draws.tolist()):
        j = i + draw % (n - i)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


class DistributedSampler:
    """Give each rank its share of a dataset's indices, as ``torch.utils.data.DistributedSampler``.

    Args:
        dataset: anything with ``len()``.
        num_replicas: number of ranks sharing the data (default: the default group's size).
        rank: this rank (default: this process's rank).
        shuffle: shuffle the indices (the same way on every rank) each epoch.
        seed: the shuffle seed; must be the same on every rank.
        drop_last: drop the tail so every rank gets the same count without padding (else
            the indices are padded with the first ones).

    Raises:
        ValueError: ``rank`` outside ``[0, num_replicas)``.

    Example:
        >>> s = DistributedSampler(range(5), num_replicas=2, rank=0, seed=3)
        >>> s.set_epoch(1); len(list(s))
        3
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            from meshcomm.distributed._state import STATE

            default = STATE.default
            if default is None:
                raise RuntimeError("Requires distributed package to be available")
            num_replicas = default.size() if num_replicas is None else num_replicas
            rank = default.rank() if rank is None else rank
        if rank >= num_replicas or rank < 0:
            raise ValueError(
                f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        n = len(dataset)
        if drop_last and n % num_replicas:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        indices = torch_randperm(n, self.seed + self.epoch) if self.shuffle else list(range(n))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            pad = self.total_size - len(indices)
            if pad and indices:
                repeats = math.ceil(pad / len(indices))
                indices += (indices * repeats)[:pad]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which changes the shuffle (call it before each epoch's loop)."""
        self.epoch = epoch

    def __repr__(self) -> str:
        args: dict[str, Any] = {
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }
        return "DistributedSampler(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
