"""`dflash-mlx bench --distributed`: the benchmark run by every rank of a group on a split target.

Every rank loads its share of the target (tensor parallel, or pipeline stages), builds the same methods and runs
the same prompts in the same order: each decoding method is a sequence of collectives the ranks must meet alike
(same tokens, same verify widths, same stops). Rank 0 prints the report and writes its files.

On top of the usual figures, the report gets a communication table: the bytes rank 0 sent and received on its
ring sockets per target pass of each method (kernel TCP counters, `comm.RingTraffic`; the prompt's prefill taken
off by a second run of one token), the collectives one pass makes, and their estimated time: the collectives
times the measured latency of one all-sum of a block as wide as the pass.
"""

from __future__ import annotations

import json
from typing import Dict, List

import mlx.core as mx

from .comm import RingTraffic, allsum_latency, collectives_per_pass, is_pipelined
from .group import barrier, rank0_first, setup
from .pipeline import FeatureExchange


def load_rank_target(cfg):
    """(model, tokenizer) for this rank: the target split over the group. Rank 0 alone writes files."""
    from mlx_lm.utils import load_tokenizer

    from ..models.loading import drafter_location, resolve_target
    from .sharding import load_sharded_model, target_path

    group = setup()
    with rank0_first(group):  # offline installs, downloads and drafter conversions write one shared cache
        path = target_path(resolve_target(cfg.model))
        if cfg.draft:
            cfg.draft = drafter_location(cfg.draft)
    if group.rank() != 0:
        cfg.out, cfg.progress = None, False
    model = load_sharded_model(str(path), group, cfg.pipeline)
    config = json.loads((path / "config.json").read_text())
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))



def drafter_for(model, drafter):
    """The drafter as a pipelined target's stages need it (fed every stage's taps); unchanged for any other."""
    return FeatureExchange(drafter) if drafter is not None and is_pipelined(model) else drafter


class Meter:
    """Counts each method run's ring traffic; `report` turns the counts into the communication table."""

    def __init__(self, methods, model):
        self.group = setup()
        self.model = model
        self.traffic = RingTraffic()
        for m in methods:
            m.run = self._metered(m.run)

    def _read(self):
        # Every rank reads its counters before any rank sends again.
        totals = self.traffic.settled(quiet=0.1) if self.traffic.available else None
        barrier(self.group)
        return totals

    def _metered(self, run):
        def metered(ids, max_tokens, stops=(), reference=None, seed=None, profile=False):
            if profile:  # the profiled runs' figures are phases, not traffic
                return run(ids, max_tokens, stops, reference, seed, profile)
            before = self._read()
            result = run(ids, max_tokens, stops, reference, seed)
            after = self._read()
            # The prompt's prefill and first pass, alone, to take off: what remains is the decode passes'.
            short = run(ids, 1, stops, reference, seed)
            end = self._read()
            if before is not None:
                result.comm = dict(bytes=(after - before).total - (end - after).total,
                                   passes=result.passes - short.passes)
            return result

        return metered

    def report(self, methods, records: List[dict]) -> Dict:
        """Per method: KB per pass, collectives per pass, estimated ms of communication per pass."""
        from ..targets import build_target

        hidden = build_target(self.model).hidden_size
        widths = {1}
        for rec in records:
            for run in rec["runs"].values():
                widths.update(block for _, block in run.cycles)
        # Collectives: every rank measures the same widths in the same order.
        latency = {w: allsum_latency(self.group, w, hidden, reps=10) for w in sorted(widths)}
        rows = []
        for m in methods:
            # A drafter on a pipeline gets its taps in one more all-sum; an adaptive width, rank 0's clock in one.
            collectives = collectives_per_pass(self.model, taps=m.kind == "dflash")
            collectives += int(getattr(m, "adaptive", False))
            runs = [rec["runs"][m.name] for rec in records]
            comm = [r.comm for r in runs if getattr(r, "comm", None)]
            passes = sum(c["passes"] for c in comm)
            # A pass that verified no block (plain decoding, a first token) moves a one-token block.
            blocks = [block for r in runs for _, block in r.cycles]
            blocks += [1] * max(0, sum(r.passes for r in runs) - len(blocks))
            est = collectives * sum(latency[b] for b in blocks) / len(blocks) if blocks else 0.0
            rows.append(dict(name=m.name, bytes_per_pass=sum(c["bytes"] for c in comm) / passes if passes else None,
                             passes=passes, collectives_per_pass=collectives, comm_ms_per_pass=1e3 * est))
        return dict(ranks=self.group.size(), mode="pipeline" if is_pipelined(self.model) else "tensor",
                    counted=self.traffic.available, allsum_ms={str(w): 1e3 * s for w, s in latency.items()},
                    methods=rows)


def format_communication(comm: Dict) -> List[str]:
    """The communication table, as lines for `format_table`."""
    out = [f"communication, {comm['ranks']} ranks, {comm['mode']} parallel (rank 0's ring sockets, decode passes "
           "only; time: collectives x one measured all-sum of the pass's width):",
           f"  {'method':<22} {'KB/pass':>9} {'collectives':>11} {'comm ms/pass':>12}"]
    for r in comm["methods"]:
        kb = f"{r['bytes_per_pass'] / 1024:.1f}" if r["bytes_per_pass"] is not None else "-"
        out.append(f"  {r['name']:<22} {kb:>9} {r['collectives_per_pass']:>11} {r['comm_ms_per_pass']:>12.2f}")
    if not comm["counted"]:
        out.append("  (bytes not counted: the ring sockets' TCP counters are Linux-only)")
    return out
