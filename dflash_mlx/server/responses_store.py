"""Past Responses API replies kept for `previous_response_id` and `GET /v1/responses/{id}`: each entry holds the
conversation as chat messages (the request's input plus the reply, `instructions` left out, as OpenAI does not
carry them over) and the response object. Bounded in entries and in bytes, least recently used dropped first, so
a long-running server holds it flat whatever clients send."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class Stored:
    messages: List[Dict[str, Any]]
    response: Dict[str, Any]
    nbytes: int


class ResponseStore:
    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: "OrderedDict[str, Stored]" = OrderedDict()
        self._lock = threading.Lock()  # handlers run on the event loop, tests and scripts may poke from threads

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, messages: List[Dict[str, Any]], response: Dict[str, Any]) -> bool:
        """Keep a reply; False when it alone is over the byte budget (then it is not kept)."""
        nbytes = len(json.dumps(messages, ensure_ascii=False)) + len(json.dumps(response, ensure_ascii=False))
        if nbytes > self.max_bytes or self.max_entries <= 0:
            return False
        with self._lock:
            self._drop(response_id)
            self._entries[response_id] = Stored(messages, response, nbytes)
            self.nbytes += nbytes
            while self._entries and (self.nbytes > self.max_bytes or len(self._entries) > self.max_entries):
                self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> Optional[Stored]:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.nbytes -= entry.nbytes
        return True
