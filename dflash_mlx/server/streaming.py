"""Reading a queued job's events for a route handler, shared by the three APIs (app: OpenAI's chat and
completions, anthropic_format, responses_format): wait for the prefill before answering, then either collect a
whole reply or stream the events as server-sent events (`sse_response`, the one streaming loop). `first_event`
and `collect` return None when the client went away meanwhile (the handler answers 499)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import DFlashError
from .errors import APIError
from .generation import Delta, Outcome
from .worker import ClientGone, Job


async def first_event(job: Job, request: Request):
    """Wait for the prefill (so errors still get a status code); None if the client left meanwhile."""
    try:
        return await job.next(request)
    except ClientGone:
        return None
    except DFlashError as e:
        raise APIError(400, str(e)) from e


async def collect(job: Job, request: Request, event, consume: Callable) -> Optional[Outcome]:
    """Feed `event` and the job's next ones to `consume` until its Outcome (a whole, non-streamed reply);
    None if the client left meanwhile."""
    while not isinstance(event, Outcome):
        consume(event)
        try:
            event = await job.next(request)
        except ClientGone:
            return None
    return event


def sse_response(job: Job, event, *, start: Callable[[], Iterable[str]], each: Callable[[Delta], Iterable[str]],
                 finish: Callable[[Outcome], Iterable[str]], error: Callable[[Exception], str],
                 done: Optional[Callable[[Outcome], None]] = None) -> StreamingResponse:
    """Stream a job whose first event is `event`: `start()`, `each(delta)` per verify pass, `finish(outcome)`,
    then `done(outcome)` (e.g. store the reply). A failure mid-stream is reported in the stream by `error(e)` (the
    status line has gone out). However it ends, the job is cancelled: a client that left stops the generation
    between two verify passes."""

    async def lines():
        current = event
        try:
            for line in start():
                yield line
            while not isinstance(current, Outcome):
                for line in each(current):
                    yield line
                current = await job.next()
            for line in finish(current):
                yield line
            if done is not None:
                done(current)
        except Exception as e:
            yield error(e)
        finally:
            job.cancel()

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
