"""The request queue and the worker thread that runs the generations, results handed back to the event loop.

Up to the generator's `max_batch` jobs run at once, interleaved on the one worker thread: each round hands every
running job its next verify pass's event, and those passes are one batched target pass (`batching.Batch`). Jobs
join (prefill) and leave between rounds. With `max_batch` 1, or a wrapped generator, one job runs at a time.

Handlers `submit` a `Job` and read its events (`Delta`s, then an `Outcome` or an exception) with `job.next()`.
A job whose client went away is `cancel`led: a queued one is skipped, a running one stops between two verify
passes. More than `max_queue` waiting jobs are refused (the handler answers 503).

`shutdown` (the HTTP server is going down) stops the running job the same way, so its reply still ends with an
Outcome (finish_reason "cancelled"), and answers the waiting ones with a 503. A pass cannot be interrupted, and a
long prompt's prefill chunk may outlast the time a stopping server has (a service manager's SIGTERM, uvicorn's
5 s for responses in flight): `ANSWER_AFTER_S` after shutdown began, a job still waiting on its pass is answered
by the worker (a 503 before its first event, a cancelled Outcome after). With `stop_by_s` set (`dflash-mlx serve`
sets `STOP_BY_S`), `stop` waits for the thread (and its flush of the prefix cache to disk) only that long;
otherwise (a server in a thread, a launcher's) up to 30 s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable, Iterator, List, Optional, Tuple

from .errors import APIError
from .generation import Delta, GenerationRequest, Generator, Outcome, PrefillProgress, cancelled_outcome

logger = logging.getLogger("dflash_mlx.server")

ANSWER_AFTER_S = 2.5  # shutdown: jobs still waiting on a pass are answered by then (inside uvicorn's 5 s)
STOP_BY_S = 3.5  # a stopping process: the worker's last pass and its flush to disk get this long, then it exits


POLL_SECONDS = 0.1  # how often a waiting handler asks whether its client is still there


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    pass


class Job:
    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._polled = time.monotonic()  # when the client was last asked whether it is still there
        self.emitted = 0  # tokens handed to the client so far
        self.started = self.ended = False  # an event, the last event (Outcome or error) has been pushed

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def push(self, item) -> None:
        if self.ended:  # answered already (the server stopped before the worker reached this event)
            return
        self.started = True
        self.ended = isinstance(item, (Outcome, BaseException))
        if isinstance(item, Delta):
            self.emitted += len(item.tokens)
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel()

    async def next(self, request=None):
        """The next Delta or the Outcome; a generation error is raised here. With `request`, the client is polled
        (at most every `POLL_SECONDS`, whether or not events keep coming: a fast generation never leaves the
        queue empty), and a client that left cancels the job (raises `ClientGone`)."""
        if request is not None and time.monotonic() - self._polled >= POLL_SECONDS:
            await self._check(request)
        getter = asyncio.ensure_future(self._events.get())
        while True:
            done, _ = await asyncio.wait({getter}, timeout=POLL_SECONDS if request is not None else None)
            if done:
                item = getter.result()
                if isinstance(item, BaseException):
                    raise item
                return item
            try:
                await self._check(request)
            except ClientGone:
                getter.cancel()
                raise

    async def _check(self, request) -> None:
        self._polled = time.monotonic()
        if await request.is_disconnected():
            self.cancel()
            raise ClientGone()


class _Chore:
    """A call to make on the worker thread (MLX housekeeping must not run beside a pass on another thread)."""

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.done = fn, concurrent.futures.Future()

    def run(self) -> None:
        try:
            self.fn()
            self.done.set_result(None)
        except Exception as e:  # reported to whoever waits on it; the worker carries on
            self.done.set_exception(e)


class Worker:
    def __init__(self, generator: Generator, max_queue: int = 64, metrics=None,
                 on_exit: Optional[Callable[[], None]] = None):
        self.generator = generator
        self.on_exit = on_exit  # run on the worker thread as it ends (e.g. write the prefix cache to disk)
        self.max_queue = max_queue
        self.metrics = metrics
        self._queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0
        self.running = 0
        self._stopping = False
        self._stop_began: Optional[float] = None  # time.monotonic() of the first shutdown
        self.stop_by_s: Optional[float] = None  # the most `stop` waits after shutdown began (None: 30 s)
        self._active: List[Tuple[Job, Iterator]] = []  # the running jobs (the worker thread's own list)
        self._thread = threading.Thread(target=self._loop, name="dflash-worker", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call_soon(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        """Run `fn` on the worker thread between passes; the future settles when it has run."""
        chore = _Chore(fn)
        self._queue.put(chore)
        return chore.done

    @property
    def max_running(self) -> int:
        """Jobs run side by side, sharing verify passes: a plain `Generator`'s `max_batch`. A wrapped generator
        (distributed serving's lockstep) runs one job at a time: its ranks must meet in the same order."""
        gen = self.generator
        return gen.max_batch if isinstance(gen, Generator) and gen.batch is not None else 1

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.waiting >= self.max_queue:
                raise QueueFull(f"{self.waiting} requests are already waiting (--max-queue {self.max_queue})")
            self.waiting += 1
        self._queue.put(job)

    def shutdown(self) -> None:
        """Stop the running generations between two verify passes and refuse the waiting ones; returns at once.
        A job still waiting on its pass `ANSWER_AFTER_S` later is answered without it."""
        if self._stopping:
            return
        self._stop_began = time.monotonic()
        self._stopping = True
        timer = threading.Timer(ANSWER_AFTER_S, self._answer_running)
        timer.daemon = True
        timer.start()

    def _answer_running(self) -> None:
        """The server is stopping and a pass outlasts its time (a long prefill chunk): answer the running jobs now,
        so that their responses end before the HTTP server cancels them. The pass itself finishes unobserved."""
        for job, _ in list(self._active):
            if not job.ended:
                job.push(cancelled_outcome(len(job.request.prompt), job.emitted) if job.started else
                         APIError(503, "the server is shutting down; retry when it is back", type="server_error"))

    @property
    def stop_deadline(self) -> Optional[float]:
        """time.monotonic() by which a stopping worker must be done (None: no deadline)."""
        if self._stop_began is None or self.stop_by_s is None:
            return None
        return self._stop_began + self.stop_by_s

    def stop(self) -> None:
        """`shutdown`, then end the thread: wait for it (its last pass, its flush to disk) until `stop_by_s` after
        shutdown began; a pass still running then is left behind with one line (the process is exiting)."""
        self.shutdown()
        self._queue.put(None)
        deadline = self.stop_deadline
        self._thread.join(timeout=30 if deadline is None else max(0.0, deadline - time.monotonic()) + 0.25)
        if self._thread.is_alive():
            logger.warning("stopping: the worker was still busy %.1f s after shutdown began (a long prompt chunk or "
                           "a write to disk); not waiting for it, what it had not written is not kept",
                           time.monotonic() - self._stop_began)

    def _start(self, job: Job, batched: bool) -> Optional[Iterator]:
        """The job's event iterator, or None when it is answered at once (client gone, shutting down)."""
        with self._lock:
            self.waiting -= 1
        if job.cancelled:
            job.push(ClientGone())
            return None
        if self._stopping:
            job.push(APIError(503, "the server is shutting down; retry when it is back", type="server_error"))
            return None
        should_stop = lambda: job.cancelled or self._stopping  # noqa: E731
        with self._lock:
            self.running += 1
        try:
            # Asked again now: the loop may have computed its limit before the generator was wrapped (distributed).
            if batched and self.max_running > 1:
                return self.generator.run(job.request, should_stop=should_stop, batched=True)
            return self.generator.run(job.request, should_stop=should_stop)
        except Exception as e:  # the client gets the error instead of waiting forever
            logger.exception("generation failed to start")
            job.push(e)
            with self._lock:
                self.running -= 1
            return None

    def _step(self, job: Job, events: Iterator) -> bool:
        """Hand the job its next event (one verify pass, shared with the other running jobs); False once done."""
        try:
            event = next(events)
        except StopIteration:
            return False
        except Exception as e:  # a failed request must not take the worker down
            logger.exception("generation failed")
            job.push(e)
            return False
        if isinstance(event, PrefillProgress):
            return True  # between two prompt chunks: nothing for the client yet
        if self.metrics is not None and isinstance(event, Outcome):
            self.metrics.record_outcome(event, self.generator.cache)
        job.push(event)
        return not isinstance(event, Outcome)

    def _loop(self) -> None:
        active = self._active
        closing = False
        while not (closing and not active):
            # Join between passes: new jobs start (and prefill) while there is room; block only when idle.
            limit = self.max_running
            while not closing and len(active) < limit:
                try:
                    job = self._queue.get(block=not active)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                    break
                if isinstance(job, _Chore):
                    job.run()
                    continue
                events = self._start(job, batched=limit > 1)
                if events is not None:
                    active.append((job, events))
            # One round: every running job gets its next event; the first to need a pass runs it for all.
            for job, events in list(active):
                if not self._step(job, events):
                    events.close()
                    active.remove((job, events))
                    with self._lock:
                        self.running -= 1
        if self.on_exit is not None:
            try:
                self.on_exit(self.stop_deadline)
            except Exception:  # the server is going down anyway: say so, and go
                logger.exception("the worker's exit task failed")
