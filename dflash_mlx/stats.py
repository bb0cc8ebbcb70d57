"""Acceptance statistics of a DFlash run: τ (mean tokens committed per verify pass) and its histogram."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class AcceptanceStats:
    cycles: int = 0
    committed: int = 0
    max_block: int = 0
    histogram: Dict[int, int] = field(default_factory=dict)  # tokens committed per cycle (acc + 1) -> count

    def record(self, accepted: int, block_size: int) -> None:
        length = accepted + 1
        self.cycles += 1
        self.committed += length
        self.max_block = max(self.max_block, block_size)
        self.histogram[length] = self.histogram.get(length, 0) + 1

    @property
    def tau(self) -> float:
        """Acceptance length: mean of (accepted drafts + 1) over verify passes."""
        return self.committed / self.cycles if self.cycles else 0.0

    def format_histogram(self, width: int = 30) -> str:
        if not self.cycles:
            return "(no verify passes)"
        top = max(self.histogram.values())
        lines = []
        for length in range(1, self.max_block + 1):
            count = self.histogram.get(length, 0)
            bar = "#" * round(width * count / top)
            lines.append(f"{length:>3} | {bar:<{width}} {count}")
        return "\n".join(lines)
