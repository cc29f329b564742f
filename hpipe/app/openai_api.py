"""The OpenAI-compatible HTTP API of ``hpipe serve`` (FastAPI): chat and text completions (streamed
as server-sent events or not), the model list, health, and Prometheus metrics.

Requests become :class:`runtime.coordinator.engine.Request` s on the shared engine (:class:`Backend`); tokens
come back through an asyncio queue per request. Text is detokenized incrementally, a few tokens at a
time, never the whole answer again: a token that ends in the middle of a character is held back
until the character is whole. Stop strings are matched on the new text: the answer is cut before
the match and the request ends at once, freeing its KV cache on every stage. A client that
disconnects, streaming or not, ends its request the same way within a second. Nothing blocks the
event loop: prompts are tokenized on a worker thread (after a length check on the characters),
and ``/health`` and ``/metrics`` read what a background collector last saw. Every field is checked
at the edge; every error is OpenAI's error object with the status a client expects, never a bare
500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpipe.app.openai_text import Stream, all_logprobs, logprob_payload
from hpipe.app.page import OPEN_PATHS, OPEN_PREFIX, add_page
from hpipe.app.serve_backend import Backend, Busy, NotReady, TooLong
from hpipe.core.errors import InputError
from hpipe.model.generate.sampling import SEED_RANGE

#: the characters a prompt may have per token the plan takes, checked before tokenizing: no
#: tokenizer of a supported family packs more than this into one token
CHARS_PER_TOKEN = 64
#: how often a non-streaming request checks whether its client is still there (seconds)
DISCONNECT_POLL_S = 0.5


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(-1, ge=-1)  # vLLM's extension: sample among the k likeliest (-1 or 0: no cut)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: keep going past end-of-sequence (benchmarks)
    # hpipe's: guess tokens from the prompt and verify them in one pass ("ngram"), or not ("off");
    # None: the server's --speculate. Greedy answers are the same either way
    speculate: Literal["ngram", "off"] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # the roles the chat templates know: any other name would go into the template verbatim
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(Sampling):
    prompt: str | list[str]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


class Gate:
    """What every request meets before the app parses anything, as plain ASGI middleware
    (Starlette's ``BaseHTTPMiddleware``, what ``@app.middleware`` makes, hides a client's
    disconnect from the endpoint, and an abandoned request would compute to its end):

    - the API key, where the server has one, on every route but ``/health`` (and ``/metrics``
      with ``--metrics-public``), the page and its assets (:mod:`hpipe.app.page`: they hold no
      data): the API, ``/api/live``, ``/docs`` and ``/openapi.json`` alike;
    - a bound on the body (``max_body`` bytes): a declared length over it is refused before a byte
      is read, a body without one is read here up to the bound and then handed on."""

    def __init__(self, app, backend: Backend, max_body: int, open_paths: frozenset[str]):
        self.app, self.backend, self.max_body, self.open_paths = app, backend, max_body, open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, headers = scope["path"], dict(scope["headers"])
        key = self.backend.api_key
        if key and path not in self.open_paths and not path.startswith(OPEN_PREFIX):
            if not hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode()):
                return await self._refuse(scope, receive, send, 401, "Incorrect API key provided", "invalid_api_key")
        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.max_body:
                return await self._refuse(scope, receive, send, 413, f"the body is over this server's "
                                          f"{self.max_body} bytes", "request_too_large")
        elif scope["method"] in ("POST", "PUT", "PATCH"):
            body, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left
                body.append(message.get("body", b""))
                size += len(body[-1])
                if size > self.max_body:
                    return await self._refuse(scope, receive, send, 413, f"the body is over this server's "
                                              f"{self.max_body} bytes", "request_too_large")
                if not message.get("more_body"):
                    break
            receive = _replay(b"".join(body), receive)
        await self.app(scope, receive, send)

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str) -> None:
        self.backend.metrics.requests.labels(scope["path"], str(status)).inc()
        await JSONResponse(error_body(message, "invalid_request_error", code), status_code=status)(scope, receive, send)


def _replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` whole once, then what the client sends next (a disconnect)."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def create_app(backend: Backend, metrics_public: bool = False) -> FastAPI:
    app = FastAPI(title="hpipe", version="1")

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        backend.metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(error_body(e.message, e.kind, e.code, e.param), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        backend.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(f"{param}: {first.get('msg', 'invalid request')}" if param else
                                       "invalid request body", "invalid_request_error", param=param),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        backend.metrics.requests.labels(request.url.path, str(e.status_code)).inc()
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal(request, e: Exception):  # a bug: the client gets an error object, the server goes on
        backend.metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(error_body(f"internal error: {e!r}", "server_error"), status_code=500)

    # a prompt the plan takes, each character JSON-escaped at worst (\\uXXXX twice), and room for the rest
    app.add_middleware(Gate, backend=backend, max_body=(1 << 20) + 12 * CHARS_PER_TOKEN * backend.plan.max_len,
                       open_paths=frozenset({"/health", *OPEN_PATHS, *(["/metrics"] if metrics_public else [])}))
    add_page(app, backend.collector.live.body,
             lambda path, status: backend.metrics.requests.labels(path, str(status)).inc())

    @app.get("/health")
    async def health():
        ready, why = backend.ready()
        return JSONResponse({"status": "ok" if ready else why}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():  # the collector's gauges: no call to a daemon here
        return Response(generate_latest(backend.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        backend.metrics.requests.labels("/v1/models", "200").inc()
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model",
                                            "created": backend.started, "owned_by": "hpipe"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HTTPRequest):
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        _check_size(backend, sum(len(m["content"]) for m in messages), "messages")
        try:
            prompt = await asyncio.to_thread(backend.chat_prompt, messages)
        except InputError as e:
            raise APIError(400, str(e), "invalid_request_error", param="messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await _complete(backend, body, request, prompt, "chat.completion", top)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        if isinstance(body.prompt, list):
            if len(body.prompt) != 1:
                raise APIError(400, "one prompt per request", "invalid_request_error", param="prompt")
            body.prompt = body.prompt[0]
        if body.echo:
            raise APIError(400, "echo is not supported", "invalid_request_error", param="echo")
        if not body.prompt:
            raise APIError(400, "the prompt is empty", "invalid_request_error", param="prompt")
        _check_size(backend, len(body.prompt), "prompt")
        prompt = await asyncio.to_thread(backend.text_prompt, body.prompt)
        return await _complete(backend, body, request, prompt, "text_completion", body.logprobs)

    return app


def _check_size(backend: Backend, chars: int, param: str) -> None:
    """Refuse a prompt too long for the plan before tokenizing it (that would take seconds)."""
    if chars > CHARS_PER_TOKEN * backend.plan.max_len:
        raise APIError(413, f"the prompt has {chars} characters; this server's plan takes at most "
                       f"{backend.plan.max_len} tokens", "invalid_request_error", "context_length_exceeded", param)


def _submit(backend: Backend, body, prompt: list[int], top: int | None, stops: list[str], on_token, on_done):
    """The request, checked, handed to the engine; what it cannot take, as the API's errors."""
    if body.model != backend.model_name:
        raise APIError(404, f"The model '{body.model}' does not exist (this server has '{backend.model_name}')",
                       "invalid_request_error", "model_not_found", "model")
    if body.n != 1:
        raise APIError(400, "n > 1 is not supported: send one request per choice", "invalid_request_error",
                       param="n")
    if len(stops) > 4:
        raise APIError(400, "at most 4 stop sequences", "invalid_request_error", param="stop")
    max_tokens = body.max_completion_tokens or body.max_tokens
    try:
        return backend.submit(prompt, max_tokens, body, top, on_token=on_token, on_done=on_done)
    except TooLong as e:
        raise APIError(413, str(e), "invalid_request_error", "context_length_exceeded", "messages") from None
    except InputError as e:
        raise APIError(400, str(e), "invalid_request_error") from None
    except Busy as e:
        raise APIError(429, str(e), "rate_limit_error", "queue_full", headers={"Retry-After": str(e.retry_after)}) \
            from None
    except NotReady as e:
        raise APIError(503, str(e), "server_error", "not_ready") from None


async def _collect(backend: Backend, r, stream: Stream, queue: asyncio.Queue, request: HTTPRequest) -> bool:
    """Wait for a whole answer into ``stream``; False when the client went away first (the request
    is cancelled then, and its KV freed)."""
    try:
        checked = time.monotonic()
        while True:
            try:
                what, token = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                what = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():  # nobody will read the answer: stop computing it
                    backend.finish(r, "cancelled")
                    return False
            if what is None:
                continue
            if what == "done":
                stream.flush()
                break
            stream.push(token)
            if stream.stopped:
                backend.finish(r, "stop")
                break
    finally:
        backend.finish(r, "cancelled")
    return True


async def _complete(backend: Backend, body, request: HTTPRequest, prompt: list[int], kind: str, top: int | None):
    path = request.url.path
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    r = _submit(backend, body, prompt, top, stops,
                on_token=lambda req, t: loop.call_soon_threadsafe(queue.put_nowait, ("token", t)),
                on_done=lambda req: loop.call_soon_threadsafe(queue.put_nowait, ("done", None)))
    rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    stream = Stream(backend, stops)
    chat = kind == "chat.completion"

    async def events():
        sent_role = False
        finish = None
        try:
            while True:
                what, token = await queue.get()
                if what == "done":
                    delta = stream.flush()
                else:
                    delta = stream.push(token)
                    if stream.stopped:
                        backend.finish(r, "stop")
                lp = logprob_payload(backend, r, chat) if top is not None and what == "token" else None
                if delta or lp or (chat and not sent_role):
                    piece = ({"role": "assistant", "content": delta} if not sent_role else {"content": delta}) \
                        if chat else None
                    sent_role = True
                    choice = {"index": 0, "finish_reason": None, "logprobs": lp}
                    choice.update({"delta": piece} if chat else {"text": delta})
                    yield _chunk(rid, created, backend.model_name, kind, choice)
                if what == "done" or stream.stopped:
                    finish = "stop" if stream.stopped or r.stop_reason in ("eos", "stop") else "length"
                    break
            if r.error:
                yield f"data: {json.dumps(error_body(r.error, 'server_error'))}\n\n"
            else:
                choice = {"index": 0, "finish_reason": finish, "logprobs": None}
                choice.update({"delta": {}} if chat else {"text": ""})
                yield _chunk(rid, created, backend.model_name, kind, choice)
                if body.stream_options and body.stream_options.include_usage:
                    yield _chunk(rid, created, backend.model_name, kind, None, _usage(r, stream))
            yield "data: [DONE]\n\n"
        finally:
            backend.finish(r, "cancelled")  # a client gone mid-stream: free its KV now (a no-op when done)

    backend.metrics.requests.labels(path, "200").inc()
    if body.stream:
        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if not await _collect(backend, r, stream, queue, request):
        return Response(status_code=499)
    if r.error:
        raise APIError(503 if "not responding" in r.error else 500, r.error, "server_error")
    finish = "stop" if stream.stopped or r.stop_reason in ("eos", "stop") else "length"
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish,
                              "logprobs": all_logprobs(backend, r, chat) if top is not None else None}
    if chat:
        choice["message"] = {"role": "assistant", "content": stream.sent}
    else:
        choice["text"] = stream.sent
    return {"id": rid, "object": kind, "created": created, "model": backend.model_name, "choices": [choice],
            "usage": _usage(r, stream)}


def _chunk(rid, created, model, kind, choice, usage=None) -> str:
    body = {"id": rid, "object": f"{kind}.chunk" if kind == "chat.completion" else kind, "created": created,
            "model": model, "choices": [choice] if choice is not None else []}
    if usage is not None:
        body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n"


def _usage(r, stream: Stream) -> dict:
    completion = len(stream.tokens)
    return {"prompt_tokens": len(r.prompt), "completion_tokens": completion,
            "total_tokens": len(r.prompt) + completion,
            # the prompt's positions read from the prefix cache, not computed (as OpenAI reports them)
            "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}
