"""Batching: ``Example`` -> right-padded ``Batch``; a resumable seeded iterator; the held-out split;
supervised-token counts (the EAGLE-3 draft vocabulary is built from them)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vatspec.data.chat import Example
from vatspec.data.records import Conversation


@dataclass
class Batch:
    """Right-padded batch. input_ids [B, T] long, attention_mask [B, T] long (1 = real token),
    loss_mask [B, T] bool (True = supervised target; always False on padding)."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor

    def __post_init__(self):
        shape = self.input_ids.shape
        assert self.input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(shape)}"
        assert self.attention_mask.shape == shape and self.loss_mask.shape == shape, (
            f"attention_mask {tuple(self.attention_mask.shape)} / loss_mask {tuple(self.loss_mask.shape)} "
            f"must match input_ids {tuple(shape)}"
        )

    def to(self, device: str | torch.device, non_blocking: bool = False) -> Batch:
        tensors = (self.input_ids, self.attention_mask, self.loss_mask)
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in tensors))

    @property
    def shape(self) -> torch.Size:
        return self.input_ids.shape


def collate(examples: Sequence[Example], pad_id: int) -> Batch:
    """Right-pad ``examples`` to the longest one -> Batch of [B, T] tensors."""
    if not examples:
        raise ValueError("collate: no examples")
    T = max(len(e) for e in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    for b, e in enumerate(examples):
        n = len(e)
        input_ids[b, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(e.loss_mask, dtype=torch.bool)
    return Batch(input_ids, attention_mask, loss_mask)


class BatchIterator:
    """Deterministic batches over ``examples``; a new seeded shuffle each epoch; resumable.

    ``for batch in it`` yields the rest of the current epoch and moves to the next epoch;
    ``next(it)`` runs forever across epochs. ``state_dict()`` is ``{epoch, index, seed}`` where
    ``index`` counts the batches of this epoch already handed out, so after
    ``load_state_dict`` the next batch is the one that would have followed.
    The order of epoch e is ``randperm(N, seed + e)``, the same on every machine and restart.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        pad_id: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not examples:
            raise ValueError("BatchIterator: no examples")
        self.examples = examples
        self.batch_size = batch_size
        self.pad_id = pad_id
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0
        if len(self) == 0:
            raise ValueError(f"{len(examples)} examples make no full batch of {batch_size} with drop_last")

    def __len__(self) -> int:
        """Batches per epoch."""
        n, bs = len(self.examples), self.batch_size
        return n // bs if self.drop_last else -(-n // bs)

    def order(self, epoch: int) -> list[int]:
        n = len(self.examples)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def __next__(self) -> Batch:
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        order = self.order(self.epoch)
        idx = order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return collate([self.examples[i] for i in idx], self.pad_id)

    def __iter__(self) -> Iterator[Batch]:
        if self.index >= len(self):
            self.epoch, self.index = self.epoch + 1, 0
        epoch = self.epoch
        while self.epoch == epoch and self.index < len(self):
            yield next(self)
        if self.epoch == epoch:
            self.epoch, self.index = epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this iterator has seed {self.seed}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def split_heldout(
    convs: Sequence[Conversation], fraction_or_n: float | int, seed: int = 0
) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic split -> ``(train, heldout)``, each in the input order.

    ``fraction_or_n``: a float in (0, 1) is a fraction (rounded, at least 1), an int is a count.
    """
    n = len(convs)
    if isinstance(fraction_or_n, float) and not isinstance(fraction_or_n, bool):
        if not 0.0 < fraction_or_n < 1.0:
            raise ValueError(f"held-out fraction must be in (0, 1), got {fraction_or_n}")
        k = max(1, round(n * fraction_or_n))
    else:
        k = int(fraction_or_n)
    if not 0 <= k <= n:
        raise ValueError(f"cannot hold out {k} of {n} conversations")
    held = set(random.Random(seed).sample(range(n), k))
    return [c for i, c in enumerate(convs) if i not in held], [c for i, c in enumerate(convs) if i in held]


def token_counts(examples: Iterable[Example], vocab_size: int) -> Tensor:
    """Counts ``[V]`` long of the supervised target tokens (``loss_mask`` True) over ``examples``."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        ids = torch.tensor([t for t, m in zip(e.input_ids, e.loss_mask) if m], dtype=torch.long)
        if ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"example {e.id!r}: token id out of range for vocab_size {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts
