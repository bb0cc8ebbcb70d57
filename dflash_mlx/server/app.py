"""The HTTP routes: OpenAI's /v1/chat/completions, /v1/completions and /v1/models, Anthropic's /v1/messages,
OpenAI's Responses API (/v1/responses, in server/responses_format.py), plus /health (GET and HEAD) and /metrics.
Handlers validate and tokenize, queue a job on the worker, and format its events.

Before a route runs, server/guard.py checks the API key and the body (JSON, its size and depth) and answers
failures nobody foresaw; server/openapi.py publishes the schema. Then every body's text is checked
(`schemas.check_text`: no lone surrogates, at most 8 bytes per token of the model's context plus 16 KiB), and
prompts are rendered and tokenized on a thread, so a big prompt neither stalls
/health nor reaches the tokenizer when it could not fit anyway. On shutdown (`Server.begin_shutdown`, called by the
uvicorn server in server/__init__.py) the running generation stops at its next verify pass, so a stream in flight
ends with its final chunk and [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from fastapi import Depends, FastAPI, Request
from mlx_lm.sample_utils import make_logits_processors
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from . import anthropic_format, chat_page, errors, guard, openapi, prompts, responses_format
from ..decode.budget import DEFAULT_TREES
from ..decode.lookup import drafter_model
from ..decode.sampling import SamplingParams
from ..errors import DFlashError
from .errors import APIError, ContextTooLong
from .generation import GenerationRequest, Generator
from .memory import MemoryKeeper
from .metrics import Metrics
from .openai_format import ChatFormatter, CompletionFormatter
from .prefix_store import PrefixStore, fingerprint, prepare_folder
from .responses_store import ResponseStore
from .schemas import ChatCompletionRequest, CompletionRequest, check_text, text_limit
from .streaming import collect, first_event, sse_response
from .text import router_for
from .tools import openai_tool_choice
from .worker import Job, QueueFull, Worker

logger = logging.getLogger("dflash_mlx.server")


@dataclass
class ServerSettings:
    """What `dflash-mlx serve` is told on its command line (model loading aside)."""

    model_name: str = "default"  # the first served name: what /health, /metrics and replies to unnamed requests show
    served_names: List[str] = field(default_factory=list)  # more names clients may send as `model` (aliases)
    drafter_name: Optional[str] = None
    api_key: Optional[str] = None
    max_queue: int = 64
    max_batch: int = 8  # requests whose verify passes are batched together (1: one at a time)
    prompt_cache_bytes: int = 2 << 30
    prompt_cache_dir: Optional[str] = None  # evicted prefix-cache entries (and all at shutdown) kept on disk here
    prompt_cache_dir_bytes: int = 16 << 30
    width: Optional[int] = None  # tokens verified per pass (None: chosen every pass)
    # Drafted blocks as trees: "auto" (chain or tree by measured speed), a fixed budget, None (chains), or
    # DEFAULT_TREES: "auto" unless the width is fixed or the request gives a seed (as `dflash-mlx generate`).
    tree_budget: Union[int, str, None] = DEFAULT_TREES
    lookup: Optional[bool] = None  # False: never draft by copying from the context (`--no-lookup`)
    default_max_tokens: Optional[int] = None  # for requests that set no limit; None: what the context leaves
    context_length: Optional[int] = None  # default: the target's max_position_embeddings
    temperature: float = 0.0  # when a request sets none (OpenAI's own default is 1.0)
    # False: a request naming a model this server does not list is served by its one model (coding agents send
    # their own ids: claude-opus-4-8, gpt-5-codex, a haiku id for side tasks). True: such a request is a 404.
    strict_model_names: bool = False
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    max_body_bytes: Optional[int] = None  # a request body's bound; None: `body_limit(context length)`

    def name_after(self, model: str, drafter: Optional[str]) -> "ServerSettings":
        """Fill the names /v1/models reports from the command's target and drafter, where none was set."""
        if self.model_name == "default":
            self.model_name = model
        if self.drafter_name is None:
            self.drafter_name = drafter or "shipped"
        return self

    @property
    def names(self) -> List[str]:
        """Every name the server answers to, the first one first, each once."""
        return list(dict.fromkeys([self.model_name, *self.served_names]))


def body_limit(context_length: Optional[int]) -> int:
    """A request body's bound: four times the text the context may hold (JSON escapes a CJK character in 6
    bytes, a newline in 2), and never under 8 MiB (tool results, images a route refuses by name)."""
    text = text_limit(context_length)
    return max(MIN_BODY_BYTES, 4 * text) if text is not None else DEFAULT_BODY_BYTES


MIN_BODY_BYTES = 8 << 20
DEFAULT_BODY_BYTES = 64 << 20  # a model whose config gives no context


def context_length_of(model) -> Optional[int]:
    args = getattr(model, "args", None)
    for source in (args, getattr(args, "text_config", None)):
        value = source.get("max_position_embeddings") if isinstance(source, dict) else \
            getattr(source, "max_position_embeddings", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class Server:
    """The served pair and everything requests share: generator, worker queue, metrics, settings."""

    def __init__(self, model, tokenizer, drafter, settings: ServerSettings):
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        self.tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
        self.settings = settings
        store = None
        if settings.prompt_cache_dir:
            store = PrefixStore(prepare_folder(settings.prompt_cache_dir),
                                fingerprint(model, drafter_model(drafter)[0]),
                                settings.prompt_cache_dir_bytes)
        self.generator = Generator(model, self.tokenizer, drafter, width=settings.width,
                                   prompt_cache_bytes=settings.prompt_cache_bytes, max_batch=settings.max_batch,
                                   store=store, tree_budget=settings.tree_budget, lookup=settings.lookup)
        self.metrics = Metrics()
        self.worker = Worker(self.generator, settings.max_queue, self.metrics, on_exit=self.generator.persist)
        self.context_length = settings.context_length or context_length_of(model)
        self.max_body_bytes = settings.max_body_bytes or body_limit(self.context_length)
        self.vocab_size = self.generator.target.vocab_size
        self.created = int(time.time())
        self._unlisted: set = set()  # names asked for that the server does not list (each logged once)

    # -- request checks ----------------------------------------------------------------------------------------
    def check_body(self, body) -> None:
        """Lone surrogates and text no context could hold: a 400 before anything renders or tokenizes."""
        check_text(body, self.context_length)

    def check_length(self, n: int) -> None:
        limit = self.context_length
        if limit is not None and n >= limit:
            raise ContextTooLong(f"this model's maximum context length is {limit} tokens, but the prompt has {n}; "
                                 "shorten the messages", n, limit)

    def check_model(self, name: Optional[str], listed: bool = False) -> str:
        """The name a request asked for (replies carry it back), or the first served one when it named none.
        Any other name is served by the one model, unless `strict_model_names` (or `listed`: the catalogue, which
        shows only the served names) makes it a 404."""
        names = self.settings.names
        if name is None:
            return names[0]
        if name not in names and not (self.settings.strict_model_names or listed):
            if name not in self._unlisted and len(self._unlisted) < 64:  # clients choose names: keep it small
                self._unlisted.add(name)
                logger.info("requests for model '%s' are served by '%s' (--strict-model-names refuses them)",
                            name, names[0])
            return name
        if name not in names:
            served = ", ".join(f"'{n}'" for n in names)
            raise APIError(404, f"the model '{name}' does not exist; this server serves {served} "
                                "(see GET /v1/models, or start it with --served-model-name NAME, repeated)",
                           param="model", code="model_not_found")
        return name

    def generation_request(self, prompt: prompts.Prompt, body, max_tokens: Optional[int], stop: List[str],
                           logprobs: bool = False, top_logprobs: int = 0) -> GenerationRequest:
        if getattr(body, "n", 1) != 1:
            raise APIError(400, f"'n' must be 1 (one reply per request), got {body.n!r}; send one request per reply",
                           param="n")
        if max_tokens is not None and max_tokens <= 0:
            raise APIError(400, f"'max_tokens' must be at least 1, got {max_tokens}", param="max_tokens")
        n = len(prompt.tokens)
        if n == 0:
            raise APIError(400, "the prompt is empty", param="messages")
        self.check_length(n)
        limit = self.context_length
        # A request without a limit gets what the context leaves (as OpenAI does): agents such as Codex send none
        # and fail a turn that ends early. `--max-tokens` caps it where set.
        max_tokens = max_tokens or self.settings.default_max_tokens or limit or NO_CONTEXT_MAX_TOKENS
        if limit is not None:
            max_tokens = min(max_tokens, limit - n)
        option = lambda name, default: default if getattr(body, name, None) is None else getattr(body, name)
        sampling = dict(temp=option("temperature", self.settings.temperature), top_p=option("top_p", 1.0),
                        top_k=option("top_k", 0), min_p=option("min_p", 0.0))
        try:
            SamplingParams(**sampling)
        except DFlashError as e:
            raise APIError(400, str(e)) from e
        sampling["seed"] = _seed(getattr(body, "seed", None))
        penalty = getattr(body, "repetition_penalty", None)
        if penalty is not None:
            sampling["repetition_penalty"] = penalty
            # Past the context it means "all of it"; MLX slices with 32-bit indices.
            sampling["repetition_context_size"] = min(getattr(body, "repetition_context_size", None) or 20,
                                                      self.context_length or MAX_REPETITION_CONTEXT,
                                                      MAX_REPETITION_CONTEXT)
        bias = getattr(body, "logit_bias", None)
        if bias:
            sampling["logits_processors"] = make_logits_processors(logit_bias=self._logit_bias(bias))
        return GenerationRequest(prompt.tokens, max_tokens, prompt.boundaries, sampling, stop, logprobs,
                                 top_logprobs)

    def _logit_bias(self, bias: Dict[str, float]) -> Dict[int, float]:
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab_size:
                raise APIError(400, f"'logit_bias' keys must be token ids in [0, {self.vocab_size}), got {key!r}",
                               param="logit_bias")
            out[token] = float(value)
        return out

    async def chat_prompt(self, *args) -> prompts.Prompt:
        """`prompts.chat_prompt` on a thread: rendering and encoding a long prompt must not stall the event loop
        (and the tokenizer's lock may be held by the worker, detokenizing)."""
        return await asyncio.to_thread(prompts.chat_prompt, self.tokenizer, *args)

    def begin_shutdown(self) -> None:
        """The server is going down: stop the running generation at its next verify pass (its stream still ends
        with a finish_reason and [DONE]) and turn the waiting ones away with a 503."""
        self.worker.shutdown()

    def submit(self, request: GenerationRequest) -> Job:
        job = Job(request, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later", type="server_overloaded") from e
        return job


NO_CONTEXT_MAX_TOKENS = 32768  # the limit of a request that sets none, for a model whose config gives no context
MAX_SEED = 2**64 - 1
MAX_REPETITION_CONTEXT = 2**31 - 1  # mx.random.key takes an unsigned 64-bit seed


def _seed(seed):
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise APIError(400, f"'seed' must be an integer from 0 to 2**64-1, got {seed!r}", param="seed")
    return seed


def _stops(stop) -> List[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _wants_origins(body) -> bool:
    """The request's `"dflash": {"origins": true}` extension: per-token origins in the reply (docs/server.md)."""
    options = (body.model_extra or {}).get("dflash")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("origins", False), bool):
        raise APIError(400, 'dflash must be an object such as {"origins": true}', param="dflash")
    return options.get("origins", False)


def _sse(data: Dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def respond_openai(request: Request, job: Job, fmt, stream: bool) -> Response:
    event = await first_event(job, request)
    if event is None:
        return Response(status_code=499)
    if not stream:
        outcome = await collect(job, request, event, fmt.add)
        return Response(status_code=499) if outcome is None else JSONResponse(fmt.response(outcome))

    def error(e: Exception) -> str:
        return _sse({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error"}})

    return sse_response(job, event,
                        start=lambda: [_sse(fmt.first_chunk())] if hasattr(fmt, "first_chunk") else [],
                        each=lambda delta: [_sse(chunk) for chunk in fmt.chunks(delta)],
                        finish=lambda outcome: [_sse(c) for c in fmt.final_chunks(outcome)] + ["data: [DONE]\n\n"],
                        error=error)


class RequestCounter:
    """Counts each response by route and status as it starts. A plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` (`@app.middleware("http")`) would hide a client's disconnect from the handlers, and a
    request whose client has gone must stop (a queued one is dropped, a prefill stops between chunks)."""

    def __init__(self, app, on_response):
        self.app, self.on_response = app, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message):
            if message["type"] == "http.response.start":
                self.on_response(scope, message["status"])
            await send(message)

        await self.app(scope, receive, counted)


def create_app(model, tokenizer, drafter, settings: Optional[ServerSettings] = None) -> FastAPI:
    """The FastAPI app serving one target/drafter pair (already loaded, e.g. by `dflash_mlx.load`)."""
    settings = settings or ServerSettings()
    server = Server(model, tokenizer, drafter, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        keeper.start()
        yield
        await keeper.stop()
        await asyncio.get_running_loop().run_in_executor(None, server.worker.stop)

    app = FastAPI(title="dflash-mlx", version=_version(), lifespan=lifespan)
    app.state.server = server
    handled = [0]  # requests answered, for the memory keeper
    # Idle spells give MLX's buffer cache and malloc's free pages back (server/memory.py).
    keeper = app.state.memory = MemoryKeeper(server.worker, lambda: handled[0])
    errors.install(app)

    async def authorize(request: Request) -> None:
        key = settings.api_key
        if not key:
            return
        if not hmac.compare_digest(guard.given_key(request.headers).encode(), key.encode()):
            raise APIError(401, "invalid API key: send 'Authorization: Bearer KEY' with the server's --api-key",
                           type="authentication_error", code="invalid_api_key")

    def count_request(scope, status: int) -> None:
        handled[0] += 1
        # Counted by route template: paths clients make up (/v1/models/ANY, 404s) must not grow the table forever.
        route = scope.get("route")
        server.metrics.record_request(getattr(route, "path", None) or "unmatched", status)

    # Outermost last: the counter sees every answer; the last resort, every failure; the key is checked before
    # a body is read.
    app.add_middleware(guard.BodyCheck, max_bytes=server.max_body_bytes)
    app.add_middleware(guard.KeyCheck, key=settings.api_key)
    app.add_middleware(guard.LastResort)
    app.add_middleware(RequestCounter, on_response=count_request)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers and uptime probes
    async def health():
        alive = server.worker.alive
        body = {"status": "ok" if alive else "worker stopped", "model": settings.model_name,
                "waiting": server.worker.waiting, "running": server.worker.running}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.api_route("/", methods=["GET", "HEAD"])  # Claude Code probes `HEAD /` as it starts
    async def root(request: Request):
        if chat_page.wanted(request.headers.get("accept", "")):  # a browser: the chat page (server/static/)
            return chat_page.index()
        return JSONResponse({"name": "dflash-mlx", "version": _version(), "model": settings.model_name,
                             "endpoints": ["/v1/chat/completions", "/v1/completions", "/v1/responses",
                                           "/v1/messages", "/v1/models", "/health", "/metrics"]})

    chat_page.add_routes(app)

    @app.get("/metrics", dependencies=[Depends(authorize)])
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.worker.waiting, server.worker.running,
                                                       settings.model_name),
                                 media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> Dict[str, Any]:
        gen = server.generator
        return {"id": name, "object": "model", "created": server.created, "owned_by": "dflash-mlx",
                "context_length": server.context_length,
                "dflash": {"drafter": settings.drafter_name,
                           "width": gen.width or (gen.drafter.block_size if gen.drafter else 1),
                           "adaptive_width": (gen.drafter is not None or gen.lookup_only) and gen.width is None}}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        return {"object": "list", "data": [model_card(name) for name in settings.names]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorize)])
    async def model(name: str):
        return model_card(server.check_model(name, listed=True))

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_body(body)
        name = server.check_model(body.model)
        response_format = (body.model_extra or {}).get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {response_format.get('type')!r} is not supported (text only)",
                           param="response_format")
        messages = prompts.openai_messages(body.messages)
        choice = openai_tool_choice(body.tool_choice, body.tools)
        tools = None if choice.mode == "none" else body.tools  # "none": the model is not told about them
        template_kwargs = dict(settings.chat_template_kwargs or {}, **(body.chat_template_kwargs or {}))
        prompt = await server.chat_prompt(messages, tools, template_kwargs, choice)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs or 0
        job = server.submit(server.generation_request(prompt, body, max_tokens, _stops(body.stop), body.logprobs,
                                                      top))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        router = router_for(server.tokenizer, prompt.text, tools, prompt.forced)
        fmt = ChatFormatter(name, server.tokenizer, router, logprobs=body.logprobs, include_usage=include_usage,
                            origins=_wants_origins(body))
        return await respond_openai(request, job, fmt, body.stream)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(body: CompletionRequest, request: Request):
        server.check_body(body)
        name = server.check_model(body.model)
        if body.echo:
            raise APIError(400, "'echo' is not supported (the reply holds the completion only); leave it out or false", param="echo")
        if isinstance(body.prompt, list) and all(isinstance(t, int) for t in body.prompt):
            server.check_length(len(body.prompt))  # before decoding them all
        prompt = await asyncio.to_thread(prompts.text_prompt, server.tokenizer, body.prompt, server.vocab_size)
        job = server.submit(server.generation_request(prompt, body, body.max_tokens, _stops(body.stop),
                                                      body.logprobs is not None, body.logprobs or 0))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = CompletionFormatter(name, server.tokenizer, logprobs=body.logprobs,
                                  include_usage=include_usage)
        return await respond_openai(request, job, fmt, body.stream)

    anthropic_format.add_routes(app, server, authorize)
    app.state.responses = ResponseStore()
    responses_format.add_routes(app, server, authorize, app.state.responses)
    openapi.install(app)
    return app


def _version() -> str:
    from .. import __version__

    return __version__
