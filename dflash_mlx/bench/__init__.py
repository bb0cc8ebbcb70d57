"""`dflash-mlx bench`: DFlash against mlx-lm on the same target, weights and prompts, in one run.

    from dflash_mlx.bench import BenchConfig, run_bench, format_table
    report = run_bench(BenchConfig(model="path/to/target", oracle=True, ar_draft="path/to/small", out="bench"))
    print(format_table(report))

Modules: `prompts` (prompt sets), `methods` (the decoders and how they are timed), `runner` (the run), `report`
(summary, JSON, table, chart).
"""

from .report import format_table
from .runner import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench", "format_table"]
