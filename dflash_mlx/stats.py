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


class CollapseWatch:
    """Notices when drafting stopped paying off: τ near 1 for many verify passes with a block larger than 1.

    Then DFlash runs slower than plain decoding. `check` returns a message once, the first time it happens.
    """

    def __init__(self, min_cycles: int = 32, max_tau: float = 1.25):
        self.min_cycles = min_cycles
        self.max_tau = max_tau
        self.fired = False

    def check(self, stats: AcceptanceStats):
        if self.fired or stats.cycles < self.min_cycles or stats.max_block < 2 or stats.tau > self.max_tau:
            return None
        self.fired = True
        return (
            f"acceptance collapsed: tau {stats.tau:.2f} over {stats.cycles} verify passes with blocks of "
            f"{stats.max_block}, so DFlash is slower than plain decoding here. Likely causes: a drafter made for "
            "another target or fine-tune, wrong target_layer_ids, a broken quantization of the drafter, or a "
            "prompt far from the drafter's training data. Try another drafter or --block-size 1."
        )
