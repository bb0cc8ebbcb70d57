"""Acceptance statistics of a run: τ (mean tokens committed per verify pass), its histogram, the verify widths
used, the passes and tokens of each draft source (the drafting proposer: a DFlash drafter, a target's MTP layers;
lookup copies; none), and the warning when the drafting proposer's acceptance collapses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .proposal import DFLASH, PLAIN, is_drafted


@dataclass
class AcceptanceStats:
    """Running statistics; `adaptive` says whether the engine chose the widths (else they were fixed)."""

    cycles: int = 0
    committed: int = 0
    max_block: int = 0
    histogram: Dict[int, int] = field(default_factory=dict)  # tokens committed per cycle (acc + 1) -> count
    widths: Dict[int, int] = field(default_factory=dict)  # verify width -> cycles
    drafted_cycles: int = 0  # cycles of width > 1 drafted by a drafting proposer (not lookup)
    drafted_accepted: int = 0  # drafts accepted in those cycles
    adaptive: bool = False
    sources: Dict[str, List[int]] = field(default_factory=dict)  # source -> [passes, tokens committed]

    def record(self, accepted: int, width: int, source: Optional[str] = None) -> None:
        """One verify pass; `source` is its proposer's name: "dflash", "mtp", "lookup", "plain", a caller's own
        (default: by its width, a DFlash drafter's block or plain decoding)."""
        source = source or (DFLASH if width > 1 else PLAIN)
        counts = self.sources.setdefault(source, [0, 0])
        counts[0] += 1
        counts[1] += accepted + 1
        length = accepted + 1
        self.cycles += 1
        self.committed += length
        self.max_block = max(self.max_block, width)
        self.histogram[length] = self.histogram.get(length, 0) + 1
        self.widths[width] = self.widths.get(width, 0) + 1
        if width > 1 and is_drafted(source):  # the collapse watch judges the drafting proposer alone
            self.drafted_cycles += 1
            self.drafted_accepted += accepted

    @property
    def tau(self) -> float:
        """Acceptance length: mean of (accepted drafts + 1) over verify passes."""
        return self.committed / self.cycles if self.cycles else 0.0

    @property
    def accepted_per_draft(self) -> float:
        """Mean drafts accepted per drafting pass (width > 1); 0 when nothing was drafted."""
        return self.drafted_accepted / self.drafted_cycles if self.drafted_cycles else 0.0

    def format_sources(self) -> str:
        """Passes and tokens per draft source: "dflash 12 passes / 40 tokens, lookup 5 / 61, plain 30 / 30"."""
        parts = [f"{name} {p} / {t}" for name, (p, t) in sorted(self.sources.items(), key=lambda i: -i[1][1])]
        return ", ".join(parts) + " (passes / tokens)" if parts else "(no verify passes)"

    def source_counts(self) -> Dict[str, Dict[str, int]]:
        """{source: {"passes": n, "tokens": n}} for machine-readable reports."""
        return {name: {"passes": p, "tokens": t} for name, (p, t) in sorted(self.sources.items())}

    def format_widths(self) -> str:
        """Verify widths used, most used first: "1 x 120, 16 x 8"."""
        ranked = sorted(self.widths.items(), key=lambda item: (-item[1], item[0]))
        return ", ".join(f"{width} x {count}" for width, count in ranked)

    def format_histogram(self, width: int = 30) -> str:
        if not self.cycles:
            return "(no verify passes)"
        top = max(self.histogram.values())
        lines = []
        for length in range(1, self.max_block + 1):
            count = self.histogram.get(length, 0)
            bar = "#" * round(width * count / top)
            lines.append(f"{length:>3} | {bar:<{width}} {count}")
        how = "chosen per pass" if self.adaptive else "fixed"
        lines.append(f"verify widths ({how}): {self.format_widths()}")
        if self.sources:
            lines.append(f"draft sources: {self.format_sources()}")
        return "\n".join(lines)


class CollapseWatch:
    """Notices when drafting stopped paying off: for many verify passes, drafts were almost never accepted.

    `check` returns a message once, the first time it happens; the message says what the engine does about it.
    """

    def __init__(self, min_cycles: int = 32, max_accepted: float = 0.25, made_for: Optional[str] = None,
                 fixed_trees: bool = False, own_layers: bool = False, min_drafted: int = 4):
        self.fixed_trees = fixed_trees  # a fixed tree budget, not a fixed width, keeps every drafting pass wide
        self.min_cycles = min_cycles
        # Drafting passes judged before a verdict: a generation whose planner chose the drafter a few times (lookup
        # or plain decoding did the rest) has not shown that the drafter collapsed.
        self.min_drafted = min_drafted
        self.max_accepted = max_accepted
        self.made_for = made_for  # the target the drafter was published for, when it was picked by that name
        self.own_layers = own_layers  # the drafts come from the target's own MTP layers, not a separate drafter
        self.fired = False

    def check(self, stats: AcceptanceStats):
        if (self.fired or stats.cycles < self.min_cycles or stats.drafted_cycles < max(1, self.min_drafted)
                or stats.accepted_per_draft > self.max_accepted):
            return None
        self.fired = True
        if self.fixed_trees:
            action = (f"every drafting pass is a tree ({stats.format_widths()}), so drafting is slower than plain "
                      "decoding here; use --tree-budget auto (the default) or off to let the engine fall back")
        elif stats.adaptive:
            action = f"falling back to plain decoding; verify widths used: {stats.format_widths()}"
        else:
            action = (f"the width is fixed ({stats.format_widths()}), so drafting is slower than plain decoding "
                      "here; leave --width out to let the engine fall back to plain decoding")
        if self.own_layers:
            causes = ("the target's own MTP layers predict it poorly on this kind of prompt (or the checkpoint's "
                      "MTP layers were not trained along with its other weights, as after a fine-tune)")
        elif self.made_for:
            # The pair was checked and the drafter is the one made for this target: the prompt is the variable.
            causes = (f"the drafter made for {self.made_for} predicts it poorly on this kind of prompt (it is weak "
                      "on text unlike its training data)")
        else:
            causes = ("Likely causes: a prompt far from the drafter's training data, a weakly trained drafter, a "
                      "drafter made for another fine-tune of this target, or a broken quantization of the drafter")
        return (
            f"acceptance collapsed: {stats.accepted_per_draft:.2f} drafts accepted per drafting pass over "
            f"{stats.drafted_cycles} passes (tau {stats.tau:.2f}); {action}. {causes[0].upper() + causes[1:]}."
        )
