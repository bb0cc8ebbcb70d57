"""Fuzz every route of `dflash-mlx serve` on the tiny demo pair, thousands of requests: valid and invalid ones from
the server's own /openapi.json (schemathesis), plus hypothesis-generated Anthropic and Responses bodies
(tests/fuzz_requests.py). The server runs on 127.0.0.1 (uvicorn, as `serve` runs it); requests go over one
keep-alive connection per source, so an answer that drops the connection shows up as a failed request.

Prints the requests sent, the answers by status, the 5xx count, the tracebacks logged, the answers that break
the rules (an error outside its route's dialect, a 400 that does not say what is wrong, a reply that does not
match the schema), and the connections dropped; exits 1 if any of those is not 0.

    python benchmarks/server_fuzz.py                     # about 5 000 requests
    python benchmarks/server_fuzz.py --examples 50 --bodies 100 --seed 7
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the shared request generators

import httpx  # noqa: E402
import requests  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

import fuzz_requests  # noqa: E402
from dflash_mlx import load  # noqa: E402
from dflash_mlx.demo import make_tiny_pair  # noqa: E402
from dflash_mlx.server import ServerSettings, create_app, start_in_thread  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


class Tally:
    def __init__(self):
        self.requests = 0
        self.statuses = collections.Counter()
        self.broken = []  # (source, what)
        self.dropped = 0

    def add(self, source: str, status: int, found) -> None:
        self.requests += 1
        self.statuses[status] += 1
        self.broken += [(source, f) for f in found]


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(self.format(record))


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.generate], derandomize=False)


def fuzz_schema(base: str, examples: int, seed_value: int, tally: Tally) -> None:
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    session = requests.Session()  # keep-alive: one connection for the run
    for operation in (result.ok() for result in schema.get_all_operations()):
        path = operation.path
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @seed(seed_value)
            @_settings(examples)
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                fuzz_requests.bounded(path, case.body)
                try:
                    response = case.call(base_url=base, session=session, timeout=120)
                except requests.ConnectionError as e:
                    tally.dropped += 1
                    tally.broken.append((operation.label, f"connection failed: {e}"))
                    return
                found = fuzz_requests.problems(path, response.status_code, response.text)
                try:
                    case.validate_response(response, checks=CHECKS)
                except (Exception, BaseExceptionGroup) as e:  # schemathesis reports failed checks as exceptions
                    found.append(f"{type(e).__name__}: {str(e)[:300]}")
                tally.add(f"{operation.label} ({mode.value})", response.status_code, found)

            try:
                run()
            except Unsatisfiable:  # nothing to get wrong in an operation without parameters
                pass
            except Exception as e:  # failures are tallied inside run(): this is schemathesis' own
                tally.broken.append((operation.label, f"the run stopped: {type(e).__name__}: {e}"))
            print(f"  {operation.label} ({mode.value}): {tally.requests} requests so far", flush=True)


def fuzz_bodies(base: str, bodies: int, seed_value: int, tally: Tally) -> None:
    with httpx.Client(base_url=base, timeout=120) as client:  # keep-alive
        for path, strategy in (("/v1/messages", fuzz_requests.anthropic_bodies()),
                               ("/v1/messages/count_tokens", fuzz_requests.anthropic_bodies()),
                               ("/v1/responses", fuzz_requests.responses_bodies())):
            @seed(seed_value)
            @_settings(bodies)
            @given(body=strategy)
            def run(body):
                try:
                    r = client.post(path, json=fuzz_requests.bounded(path, body))
                except httpx.TransportError as e:
                    tally.dropped += 1
                    tally.broken.append((path, f"connection failed: {e}"))
                    return
                tally.add(path, r.status_code, fuzz_requests.problems(path, r.status_code, r.text))

            try:
                run()
            except Exception as e:  # a failed assertion cannot come from run(): this is the generator's own
                tally.broken.append((path, f"the run stopped: {type(e).__name__}: {e}"))
            print(f"  {path} (generated bodies): {tally.requests} requests so far", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=250, help="schemathesis cases per operation and mode")
    parser.add_argument("--bodies", type=int, default=600, help="generated Anthropic/Responses bodies per route")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    logged = Logged()
    for name in ("dflash_mlx", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).addHandler(logged)
    work = Path(tempfile.mkdtemp(prefix="dflash-fuzz-"))
    target_dir, drafter_dir = make_tiny_pair(work)
    app = create_app(*load(str(target_dir), str(drafter_dir)), ServerSettings(model_name="tiny"))
    running = start_in_thread(app)
    tally = Tally()
    tic = time.perf_counter()
    try:
        print(f"fuzzing {running.base} (pid {os.getpid()})", flush=True)
        fuzz_schema(running.base, args.examples, args.seed, tally)
        fuzz_bodies(running.base, args.bodies, args.seed, tally)
    finally:
        running.stop()
    seconds = time.perf_counter() - tic
    tracebacks = fuzz_requests.traceback_lines(logged.lines)
    server_errors = sum(n for status, n in tally.statuses.items() if status >= 500 and status != 503)
    print(f"\nrequests {tally.requests} in {seconds:.0f} s")
    print("statuses " + ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items())))
    print(f"5xx {server_errors}")
    print(f"tracebacks {len(tracebacks)}")
    print(f"rule breaks {len(tally.broken)}")
    print(f"connections dropped {tally.dropped}")
    for source, what in tally.broken[:20]:
        print(f"  {source}: {what}")
    for line in tracebacks[:3]:
        print(line)
    return 1 if server_errors or tracebacks or tally.broken or tally.dropped else 0


if __name__ == "__main__":
    sys.exit(main())
