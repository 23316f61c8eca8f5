"""How the rows of a grouped expert matmul are laid out: sorted by expert, one contiguous run per expert."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class ExpertGroups:
    """Group g is rows offsets[g]:offsets[g+1] of the input, computed with the weights in slot slots[g] of a
    stacked expert weight. Plain Python lists: the host decides them after routing, kernels read them once."""

    slots: list[int]
    offsets: list[int]  # len(slots) + 1 entries, offsets[0] == 0, non-decreasing
    cache: dict = field(default_factory=dict, repr=False)  # per-kernel tables derived from the groups, made once

    def __post_init__(self):
        if (
            len(self.offsets) != len(self.slots) + 1
            or self.offsets[0] != 0
            or any(b < a for a, b in zip(self.offsets, self.offsets[1:]))
        ):
            raise ValueError(f"bad expert groups: slots {self.slots}, offsets {self.offsets}")

    @property
    def rows(self) -> int:
        return self.offsets[-1]

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        """(slot, first row, end row) of each non-empty group."""
        for slot, begin, end in zip(self.slots, self.offsets, self.offsets[1:]):
            if end > begin:
                yield slot, begin, end
