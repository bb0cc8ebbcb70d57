"""A recording reverse proxy for agent clients: forwards every request to a server and keeps each request (method,
path, query, the headers that matter, JSON body) and its response status and SSE event names as one JSON file.

    python tests/agents/recorder.py --upstream http://127.0.0.1:8080 --port 8090 --out recorded/

Used to capture what Claude Code and Codex really send (the fixtures in tests/fixtures/agents/) and, in the slow
end-to-end tests, to check that every answer they got was a 2xx.
"""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from typing import Any, Dict, List

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

KEPT_HEADERS = ("anthropic-beta", "anthropic-version", "content-type", "user-agent", "openai-beta", "accept")


class Recorder:
    def __init__(self, upstream: str, out: Path):
        self.upstream = upstream.rstrip("/")
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.count = 0
        self.log: List[Dict[str, Any]] = []
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None))

    def _save(self, record: Dict[str, Any]) -> None:
        with self.lock:
            self.count += 1
            record["index"] = self.count
            self.log.append(record)
            name = f"{self.count:03d}_{record['method']}_{record['path'].strip('/').replace('/', '_') or 'root'}.json"
            (self.out / name).write_text(json.dumps(record, indent=1, ensure_ascii=False))

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        record = {"method": request.method, "path": request.url.path, "query": request.url.query,
                  "headers": {k: v for k, v in headers.items() if k.lower() in KEPT_HEADERS}, "body": body}
        upstream = self.client.build_request(request.method, self.upstream + request.url.path,
                                             params=request.url.query, headers=headers, content=raw)
        reply = await self.client.send(upstream, stream=True)
        record["status"] = reply.status_code
        kept = {k: v for k, v in reply.headers.items() if k.lower() not in ("content-length", "transfer-encoding",
                                                                           "content-encoding")}
        if "text/event-stream" not in reply.headers.get("content-type", ""):
            data = await reply.aread()
            await reply.aclose()
            try:
                record["response"] = json.loads(data) if data else None
            except ValueError:
                record["response"] = data.decode("utf-8", "replace")
            self._save(record)
            return Response(data, status_code=reply.status_code, headers=kept)

        events: List[str] = []

        async def relay():
            try:
                async for chunk in reply.aiter_raw():
                    for line in chunk.decode("utf-8", "replace").splitlines():
                        if line.startswith("event:"):
                            events.append(line[6:].strip())
                    yield chunk
            finally:
                await reply.aclose()
                record["events"] = events
                self._save(record)

        return StreamingResponse(relay(), status_code=reply.status_code, headers=kept)


def make_app(upstream: str, out: Path) -> Starlette:
    recorder = Recorder(upstream, out)
    methods = ["GET", "POST", "HEAD", "DELETE", "PUT", "OPTIONS"]
    app = Starlette(routes=[Route("/{path:path}", recorder.handle, methods=methods)])
    app.state.recorder = recorder
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    uvicorn.run(make_app(args.upstream, Path(args.out)), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
