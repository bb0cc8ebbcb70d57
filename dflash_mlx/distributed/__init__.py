"""DFlash over several machines: the target split across the ranks of an `mx.distributed` group.

Start one copy of the program per machine with MLX's launcher, e.g.

    mlx.launch --hostfile hosts.json -- dflash-mlx generate -m MODEL -p "..."   # or chat, serve, bench

and every rank loads its share of the target (tensor parallel by default, `pipeline=True` for stages), keeps a
whole drafter, and runs the same decoding loop: the drafts, acceptance and sampling decisions agree on every rank
because their inputs and random keys do. Rank 0 prints. From Python:

    from dflash_mlx import stream_generate
    from dflash_mlx.distributed import load
    model, tokenizer, drafter = load("path/to/model", drafter="path/to/drafter")
    for r in stream_generate(model, tokenizer, "Hello", drafter=drafter, max_tokens=64):
        print(r.text, end="")

Modules: `group` (joining the group, shared seed, rank-0 output), `sharding` (checks and loading), `pipeline`
(a pipeline stage as a DFlash target), `serving` (`serve`: rank 0's HTTP requests run in lockstep on every rank),
`bench` (`bench --distributed`), `comm` (bytes on the wire and collectives, for benchmarks), `local` (starting
ranks on this machine, for tests and benchmarks).
"""

from .group import SharedClock, agree_on_width, launched, setup, shared_seed
from .pipeline import FeatureExchange, PipelineTarget
from .sharding import check_shardable, load, load_sharded_model, shard_model

__all__ = ["FeatureExchange", "PipelineTarget", "SharedClock", "agree_on_width", "check_shardable", "launched",
           "load", "load_sharded_model", "setup", "shard_model", "shared_seed"]
