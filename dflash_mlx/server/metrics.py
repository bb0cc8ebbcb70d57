"""Server counters, exposed at GET /metrics in Prometheus' text format (no client library needed)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, Tuple


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Dict[Tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.prefilled_tokens = 0
        self.generations = 0
        self.cancelled = 0
        self.fallbacks = 0
        self.collapsed = 0
        self.cycles = 0
        self.committed = 0
        self.drafted = 0
        self.accepted = 0
        self.verify_widths: Dict[str, int] = defaultdict(int)
        self.generation_seconds = 0.0
        self.last_generation_tps = 0.0
        self.last_tau = 0.0
        self.cache_state = (0, 0, 0, 0, 0)  # entries, bytes, hits, misses, evictions

    def record_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def record_outcome(self, outcome, cache) -> None:
        s = outcome.stats
        with self._lock:
            self.generations += 1
            self.cancelled += outcome.finish_reason == "cancelled"
            self.prompt_tokens += outcome.prompt_tokens
            self.completion_tokens += outcome.completion_tokens
            self.cached_tokens += outcome.cached_tokens
            self.prefilled_tokens += outcome.prefilled_tokens
            self.fallbacks += bool(s["fallback"])
            self.collapsed += bool(s.get("collapsed"))
            self.cycles += s["cycles"]
            self.committed += round(s["tau"] * s["cycles"])
            self.drafted += s["drafted"]
            self.accepted += s["accepted"]
            for width, count in s["verify_widths"].items():
                self.verify_widths[width] += count
            if s["generation_tps"] > 0:
                self.generation_seconds += outcome.completion_tokens / s["generation_tps"]
                self.last_generation_tps = s["generation_tps"]
            self.last_tau = s["tau"]
            self.cache_state = (len(cache), cache.nbytes, cache.hits, cache.misses, cache.evictions)

    def render(self, waiting: int, running: int, model: str) -> str:
        lines = []

        def metric(name: str, kind: str, help: str, samples):
            lines.append(f"# HELP dflash_{name} {help}")
            lines.append(f"# TYPE dflash_{name} {kind}")
            for labels, value in samples:
                label = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"dflash_{name}{label} {value}")

        with self._lock:
            entries, nbytes, hits, misses, evictions = self.cache_state
            metric("requests_total", "counter", "HTTP requests by route and status.",
                   [({"route": r, "status": s}, n) for (r, s), n in sorted(self.requests.items())])
            metric("generations_total", "counter", "Generations run.", [({}, self.generations)])
            metric("generations_cancelled_total", "counter", "Generations stopped because the client left.",
                   [({}, self.cancelled)])
            metric("fallback_generations_total", "counter", "Generations that ran as plain decoding.",
                   [({}, self.fallbacks)])
            metric("collapsed_generations_total", "counter", "Generations whose drafts were almost never accepted "
                   "(the drafter does not fit this target or this kind of text).", [({}, self.collapsed)])
            metric("prompt_tokens_total", "counter", "Prompt tokens received.", [({}, self.prompt_tokens)])
            metric("prompt_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
                   [({}, self.cached_tokens)])
            metric("prompt_prefilled_tokens_total", "counter", "Prompt tokens run through the target.",
                   [({}, self.prefilled_tokens)])
            metric("completion_tokens_total", "counter", "Tokens generated.", [({}, self.completion_tokens)])
            metric("generation_seconds_total", "counter", "Time spent generating after the first token.",
                   [({}, round(self.generation_seconds, 6))])
            metric("generation_tokens_per_second", "gauge", "Decoding speed of the last generation.",
                   [({}, self.last_generation_tps)])
            metric("verify_passes_total", "counter", "Target verify passes.", [({}, self.cycles)])
            metric("drafted_tokens_total", "counter", "Draft tokens verified.", [({}, self.drafted)])
            metric("accepted_tokens_total", "counter", "Draft tokens accepted.", [({}, self.accepted)])
            metric("tau", "gauge", "Mean tokens committed per verify pass, over all generations.",
                   [({}, round(self.committed / self.cycles, 4) if self.cycles else 0.0)])
            metric("last_tau", "gauge", "Tokens committed per verify pass in the last generation.",
                   [({}, self.last_tau)])
            metric("verify_width_total", "counter", "Verify passes by width (tokens verified).",
                   [({"width": w}, n) for w, n in sorted(self.verify_widths.items(), key=lambda x: int(x[0]))])
            metric("prefix_cache_entries", "gauge", "Snapshots held by the prefix cache.", [({}, entries)])
            metric("prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", [({}, nbytes)])
            metric("prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", [({}, hits)])
            metric("prefix_cache_misses_total", "counter", "Requests with no cached prefix.", [({}, misses)])
            metric("prefix_cache_evictions_total", "counter", "Snapshots dropped for the byte budget.",
                   [({}, evictions)])
        metric("queue_waiting", "gauge", "Requests waiting for the worker.", [({}, waiting)])
        metric("queue_running", "gauge", "Requests being generated.", [({}, running)])
        metric("model_info", "gauge", "The served model.", [({"model": model}, 1)])
        return "\n".join(lines) + "\n"
