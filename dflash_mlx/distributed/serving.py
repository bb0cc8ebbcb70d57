"""`dflash-mlx serve` under `mlx.launch`: rank 0 owns the HTTP port, every rank generates in lockstep.

Rank 0 runs the usual server; its worker's generator is wrapped in `Lockstep`, which, before each generation,
sends the request (prompt token ids, limits, sampling parameters, stop strings) to the other ranks. They wait in
`follow`, run the same `Generator.run` on their share of the target, and meet rank 0 in the same collectives.
Decisions that only rank 0 can make are shared at the points where every rank asks for them:
- stopping (a client that went away, a server shutting down): the generator asks `should_stop` between two verify
  passes on every rank; the answer is rank 0's, sent in a 4-byte all-sum, so all ranks stop after the same pass;
- the prefix cache: every rank keeps its own, and before each request the ranks compare a digest of its keys
  (stages of a pipeline hold different bytes, so their evictions can differ); on a mismatch all of them drop it.
- the random seed of a sampled request that has none: drawn on rank 0 and sent with the request (MLX's random
  state belongs to a thread, and rank 0 generates on its server thread).
Shutdown reaches every rank as an empty request. Every message is a collective on the engine's stream, so it is
ordered behind whatever that stream still has in flight, on every rank alike.

This module sits above `dflash_mlx.server`, which knows nothing of ranks: rank 0 serves through the server's
`serve_loaded`, handing it the target loaded here and a hook that wraps the worker's generator in `Lockstep`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
import signal
import sys
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from ..errors import DFlashError
from ..server import ServerSettings, serve_loaded
from ..server.generation import GenerationRequest, Generator
from .group import launched, setup
from .sharding import load

logger = logging.getLogger("dflash_mlx.server")


def _stream():
    from mlx_lm.generate import generation_stream

    return generation_stream


def broadcast_bytes(group: mx.distributed.Group, payload: Optional[bytes]) -> bytes:
    """Rank 0's `payload` on every rank (others pass None): its length, then its bytes, each in one all-sum."""
    mine = payload if group.rank() == 0 else b""
    n = int(mx.distributed.all_sum(mx.array(len(mine), dtype=mx.int32), group=group, stream=_stream()).item())
    if n == 0:
        return b""
    data = np.frombuffer(mine, dtype=np.uint8) if group.rank() == 0 else np.zeros(n, dtype=np.uint8)
    summed = mx.distributed.all_sum(mx.array(data), group=group, stream=_stream())
    return bytes(np.array(summed, copy=False))


def agree(group: mx.distributed.Group, rank0_says: bool) -> bool:
    """Rank 0's yes or no, on every rank."""
    mine = int(bool(rank0_says)) if group.rank() == 0 else 0
    return bool(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group, stream=_stream()).item())


# -- requests on the wire ------------------------------------------------------------------------------------------
_FIELDS = ("prompt", "max_tokens", "boundaries", "stop", "logprobs", "top_logprobs")


def encode_request(req) -> bytes:
    """A `GenerationRequest` as JSON bytes; the sampling parameters must be plain values."""
    sampling = dict(req.sampling)
    if sampling.pop("logits_processors", None):
        raise DFlashError("logit_bias is not supported when the model is split over several machines")
    body = {name: getattr(req, name) for name in _FIELDS}
    body["sampling"] = sampling
    return json.dumps(body).encode()


def decode_request(payload: bytes) -> GenerationRequest:
    return GenerationRequest(**json.loads(payload.decode()))


def cache_digest(cache) -> bytes:
    """The prefix cache's keys in eviction order: equal digests mean equal lookups."""
    h = hashlib.sha1()
    for node in cache.lru.values():
        key, n = [], node
        while n is not None:
            key[:0] = n.edge
            n = n.parent
        h.update(np.asarray(key, dtype=np.int64).tobytes() + b"|")
    return h.digest()[:16]


def agree_on_cache(group: mx.distributed.Group, generator) -> bool:
    """Compare every rank's prefix-cache digest with rank 0's; on any difference all ranks clear theirs.
    Returns whether they agreed."""
    mine = np.frombuffer(cache_digest(generator.cache), dtype=np.int32)
    gathered = np.array(mx.distributed.all_gather(mx.array(mine), group=group, stream=_stream()))
    same = bool((gathered.reshape(group.size(), -1) == gathered[: mine.size]).all())
    if not same:
        generator.cache.clear()
    return same


class Lockstep:
    """Rank 0's generator: sends each request to the other ranks and shares its stop decisions with them."""

    def __init__(self, generator, group: mx.distributed.Group):
        self.generator, self.group = generator, group

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def run(self, req, should_stop: Callable[[], bool] = lambda: False) -> Iterator:
        if req.sampling.get("temp", 0) > 0 and req.sampling.get("seed") is None:
            # MLX's random state belongs to a thread: rank 0 generates on its server thread, the others on their
            # main thread, so an unseeded request would draw different numbers on each. One seed for all of them.
            req = dataclasses.replace(req, sampling=dict(req.sampling, seed=secrets.randbelow(2**31 - 1)))
        broadcast_bytes(self.group, encode_request(req))
        if not agree_on_cache(self.group, self.generator):
            logger.warning("the ranks' prefix caches differed; every rank dropped its cache")
        yield from self.generator.run(req, should_stop=lambda: agree(self.group, should_stop()))


def follow(generator, group: mx.distributed.Group) -> None:
    """Ranks other than 0: run every request rank 0 sends, in lockstep, until it sends the empty one."""
    while True:
        payload = broadcast_bytes(group, None)
        if not payload:
            return
        req = decode_request(payload)
        agree_on_cache(group, generator)
        try:
            for _ in generator.run(req, should_stop=lambda: agree(group, False)):
                pass
        except Exception:  # rank 0 met the same failure (same inputs) and reports it to its client
            logger.exception("generation failed")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def serve_ranks(model: str, drafter: Optional[str], *, host: str, port: int, quant: Optional[str],
                settings: ServerSettings, log_level: str = "info", pipeline: bool = False) -> None:
    """`serve` for one rank of a job started by `mlx.launch`: rank 0 listens on host:port, the others follow."""
    if not launched():
        raise DFlashError("--pipeline splits a model over several machines: start the command with mlx.launch")
    target, tokenizer, draft = load(model, drafter, quant=quant, pipeline=pipeline)
    group = setup()
    settings.name_after(model, drafter)
    if not isinstance(settings.tree_budget, int):
        # Ranks must choose every pass alike, and "auto" chooses by each rank's own clock: chains, unless the
        # user fixed a budget (which every rank follows without measuring).
        settings.tree_budget = None
    if group.rank() != 0:
        follow(Generator(target, tokenizer, draft, width=settings.width,
                         prompt_cache_bytes=settings.prompt_cache_bytes,
                         tree_budget=settings.tree_budget, lookup=settings.lookup), group)
        return
    # uvicorn re-raises the signal it shut down for once it is done; SIGTERM's default action would end this
    # process before the other ranks are told, so it becomes the same exception as Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    worker = None

    def lockstep(app) -> None:
        nonlocal worker
        worker = app.state.server.worker
        worker.generator = Lockstep(worker.generator, group)  # before the first request: read for every job

    try:
        serve_loaded(target, tokenizer, draft, settings, host=host, port=port, log_level=log_level, on_app=lockstep)
    finally:
        if worker is not None:
            worker.stop()  # a generation still running stops between two passes, on every rank
        mx.synchronize(_stream())
        broadcast_bytes(group, b"")  # the other ranks leave `follow`
        print(f"dflash-mlx serve: stopped {group.size()} ranks", file=sys.stderr)


def check_rank_options(*, draft: Optional[str], prompt_cache_dir: Optional[str]) -> None:
    """Refuse the `dflash-mlx serve` options that ranks cannot follow (under `mlx.launch` or with --pipeline),
    before the options are checked as for one process (`settings_from_cli`) and `serve_ranks`."""
    if draft == "lookup":
        raise DFlashError("serve --draft lookup is not supported when the target is split over ranks; serve it "
                          "in one process, or give a drafter")
    if prompt_cache_dir:
        raise DFlashError("--prompt-cache-dir is not supported when the target is split over ranks (every rank "
                          "must restore the same caches); serve without it")
