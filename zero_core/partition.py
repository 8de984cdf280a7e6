"""Flat partitioning: which contiguous slice of a parameter each rank owns.

ZeRO partitions every parameter across the N data-parallel ranks (ZeRO §5). Here a layer's parameters
(weight and bias) are flattened into one vector of `numel` elements and cut into N equal chunks of
`ceil(numel / N)` elements; rank r owns chunk r. Equal chunks are what reduce-scatter and all-gather
need; the last chunks are padded with zeros to get them, and that padding is reported on its own,
never counted as model state. This works for any N, including N = 1 and numel < N (ranks past the end
own only padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatPartition:
    """How one flat parameter of `numel` elements is split over `world_size` ranks."""

    numel: int
    world_size: int

    def __post_init__(self) -> None:
        if self.numel < 1:
            raise ValueError(f"a flat parameter needs at least one element, got numel={self.numel}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")

    @property
    def chunk_numel(self) -> int:
        """Elements per rank, padding included: ceil(numel / N)."""
        return -(-self.numel // self.world_size)

    @property
    def padded_numel(self) -> int:
        return self.chunk_numel * self.world_size

    @property
    def padding(self) -> int:
        """Zero elements appended so that the flat vector divides into N equal chunks."""
        return self.padded_numel - self.numel

    def owned_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the *real* elements rank owns; empty (start == end) past the end."""
        self._check_rank(rank)
        start = min(rank * self.chunk_numel, self.numel)
        end = min(start + self.chunk_numel, self.numel)
        return start, end

    def owned_numel(self, rank: int) -> int:
        start, end = self.owned_range(rank)
        return end - start

    def padding_of(self, rank: int) -> int:
        """Padding elements at the end of rank's chunk."""
        return self.chunk_numel - self.owned_numel(rank)

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """A padded copy of rank's chunk of `flat` (numel elements): `chunk_numel` elements."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected a flat tensor of {self.numel} elements, got {tuple(flat.shape)}")
        start, end = self.owned_range(rank)
        chunk = flat.new_zeros(self.chunk_numel)
        chunk[: end - start] = flat[start:end]
        return chunk

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """`flat` with zeros appended up to `padded_numel` (a new tensor)."""
        return self.pack([flat])

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors flattened one after another into a new zero-padded buffer of `padded_numel`."""
        total = sum(t.numel() for t in tensors)
        if total != self.numel:
            raise ValueError(
                f"expected {self.numel} elements in all, got {total} in shapes {[list(t.shape) for t in tensors]}"
            )
        pieces = [t if t.dim() == 1 else t.reshape(-1) for t in tensors]
        if self.padding:
            pieces.append(tensors[0].new_zeros(self.padding))
        return torch.cat(pieces)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one 1-D tensor (a new storage)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat` with the given shapes, in order (flat may be longer: padding is ignored).

    The pieces are cut by slicing: unlike `split` or `view`, slicing keeps the interpreter lock, and on
    the virtual cluster every release of that lock is a chance for another rank thread to take the CPU.
    """
    sizes = [shape.numel() for shape in shapes]
    if sum(sizes) > flat.numel():
        raise ValueError(f"shapes need {sum(sizes)} elements but the flat tensor has {flat.numel()}")
    views, offset = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        piece = flat[offset : offset + size]
        views.append(piece if len(shape) == 1 else piece.view(shape))
        offset += size
    return views
