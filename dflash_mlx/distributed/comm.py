"""Communication accounting: bytes this rank moved over its ring-backend connections, read from the kernel.

MLX's ring backend talks over plain TCP sockets inside this process. `RingTraffic` finds them (the sockets whose
local or peer address is one of the hostfile's) and reads each one's TCP counters (`TCP_INFO`: bytes the peer
acknowledged, bytes received; retransmissions are not counted twice), so a benchmark can report what one decoding
cycle really moved, not an estimate. The kernel may still be delivering the last bytes when a collective returns:
`settled()` waits until the counters stop moving. Linux only; on other systems, or with another backend,
`RingTraffic.available` is False.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Dict, List, Set, Tuple

# Offsets of tcpi_bytes_acked and tcpi_bytes_received in Linux's `struct tcp_info` (include/uapi/linux/tcp.h).
_BYTES_ACKED_OFFSET = 120
_BYTES_RECEIVED_OFFSET = 128
_TCP_INFO_LEN = 256


@dataclass(frozen=True)
class Traffic:
    sent: int = 0
    received: int = 0

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.sent - other.sent, self.received - other.received)

    @property
    def total(self) -> int:
        return self.sent + self.received


def hostfile_addresses(path: str) -> Set[Tuple[str, int]]:
    """(ip, port) of every rank in a ring hostfile: `[["ip:port", ...], ...]`, one list per rank."""
    with open(path) as f:
        ranks = json.load(f)
    addresses = set()
    for rank in ranks:
        for entry in rank:
            host, port = entry.rsplit(":", 1)
            addresses.add((host, int(port)))
    return addresses


class RingTraffic:
    """Running totals of the bytes this process sent and received on its ring connections."""

    def __init__(self, hostfile: str = ""):
        hostfile = hostfile or os.environ.get("MLX_HOSTFILE", "")
        self.sockets: List[socket.socket] = []
        if not hostfile or not os.path.exists(hostfile) or not hasattr(socket, "TCP_INFO"):
            return
        try:
            addresses = hostfile_addresses(hostfile)
        except (OSError, ValueError):
            return
        self.sockets = list(_ring_sockets(addresses).values())

    @property
    def available(self) -> bool:
        return bool(self.sockets)

    def totals(self) -> Traffic:
        sent = received = 0
        for s in self.sockets:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(info) < _BYTES_RECEIVED_OFFSET + 8:  # a kernel older than 4.1 has no byte counters
                return Traffic()
            sent += struct.unpack_from("Q", info, _BYTES_ACKED_OFFSET)[0]
            received += struct.unpack_from("Q", info, _BYTES_RECEIVED_OFFSET)[0]
        return Traffic(sent, received)

    def settled(self, quiet: float = 0.25, limit: float = 3.0) -> Traffic:
        """The totals once they have not moved for `quiet` seconds (at most `limit` seconds of waiting)."""
        deadline = time.monotonic() + limit
        last = self.totals()
        while time.monotonic() < deadline:
            time.sleep(quiet)
            now = self.totals()
            if now == last:
                break
            last = now
        return last

    def close(self) -> None:
        # These are duplicates of MLX's descriptors: closing them leaves MLX's connections open.
        for s in self.sockets:
            s.close()
        self.sockets = []


def _ring_sockets(addresses: Set[Tuple[str, int]]) -> Dict[str, socket.socket]:
    """Duplicates of this process's TCP sockets that connect two hostfile addresses, one per kernel socket."""
    found: Dict[str, socket.socket] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not link.startswith("socket:") or link in found:
            continue
        try:
            s = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            ends = {s.getsockname()[:2], s.getpeername()[:2]}
        except OSError:  # listening or not an IPv4 stream socket
            s.close()
            continue
        if ends & addresses:
            found[link] = s
        else:
            s.close()
    return found


def is_pipelined(model) -> bool:
    """Whether an mlx-lm model was split into pipeline stages (mlx-lm's `pipeline()`)."""
    from ..targets.families import text_lm

    return getattr(getattr(text_lm(model), "model", None), "pipeline_size", 1) > 1


def allsum_latency(group, rows: int, hidden: int, reps: int = 20) -> float:
    """Seconds one all-sum of a [1, rows, hidden] fp32 block takes on `group` (median of `reps`, after a warm-up).

    Every rank must call it with the same arguments (it is a collective)."""
    import statistics

    import mlx.core as mx

    x = mx.ones((1, rows, hidden))
    mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(reps):
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def collectives_per_pass(model, taps: bool = True) -> int:
    """Collectives one forward pass of a split mlx-lm model makes.

    Tensor parallel: one all-sum per sharded output projection and per module that sums its own output (mlx-lm's
    `sharding_group`). Pipeline: the stage hand-off and the all-gather of the final hidden state, plus (`taps`)
    the all-sum that brings the drafter the tapped features of the committed positions.
    """
    if is_pipelined(model):
        return 2 + int(taps)
    n = 0
    for _, m in model.named_modules():
        if type(m).__name__.endswith("ShardedToAllLinear") or getattr(m, "sharding_group", None) is not None:
            n += 1
    return n
