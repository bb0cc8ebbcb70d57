"""Reading a queued job's events for a route handler, shared by the OpenAI routes (app) and Anthropic's
(anthropic_format): wait for the prefill before answering, then either stream the events or collect a whole reply.
Both return None when the client went away meanwhile (the handler answers 499)."""

from __future__ import annotations

from typing import Callable, Optional

from fastapi import Request

from ..errors import DFlashError
from .errors import APIError
from .generation import Outcome
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
