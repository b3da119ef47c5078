"""A small OpenAI-compatible HTTP API (Starlette ASGI, run by uvicorn) over a ``LocalModel``, so one client
code path (``planners.openai.EndpointPlanner``) serves GPT-4o, a vLLM server or our own model.

Routes: ``POST /v1/chat/completions`` (``model``, ``messages``, ``max_tokens`` or ``max_completion_tokens``,
``temperature``, ``seed``, ``response_format`` of type ``json_schema`` (constrained decoding over the
supported subset, see ``json_constraint``) or ``text``) and ``GET /v1/models``. Bad requests (malformed
JSON, unsupported schemas or messages) are HTTP 400 with an OpenAI-style ``{"error": {...}}`` body; the
model runs in a worker thread, one request at a time.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from histeve_jax.harness.json_constraint import UnsupportedSchema


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": None}}, status_code=status)


def _schema_of(body: dict[str, Any]) -> Any:
    fmt = body.get("response_format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") != "json_schema":
        raise ValueError(f"response_format.type: only 'json_schema' and 'text' are supported, got "
                         f"{fmt.get('type')!r}")
    js = fmt.get("json_schema") or {}
    if "schema" not in js:
        raise ValueError("response_format.json_schema.schema: missing")
    return js["schema"]


def make_app(model: Any, *, max_tokens_cap: int = 1024) -> Starlette:
    """The ASGI app serving ``model`` (a ``LocalModel``) under its ``name``."""

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model.name, "object": "model", "created": 0, "owned_by": "histeve_jax"}]})

    async def chat(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "messages: a non-empty list is required")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= max_tokens_cap:
            return _error(400, f"max_tokens: must be an integer in [1, {max_tokens_cap}], got {max_tokens!r}")
        temperature = body.get("temperature", 0.0)
        if not isinstance(temperature, int | float) or temperature < 0:
            return _error(400, f"temperature: must be a number >= 0, got {temperature!r}")
        try:
            schema = _schema_of(body)
            out = await run_in_threadpool(model.chat, body["messages"], schema=schema, max_tokens=max_tokens,
                                          temperature=float(temperature), seed=int(body.get("seed") or 0))
        except (UnsupportedSchema, ValueError, TypeError) as e:
            return _error(400, str(e))
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or model.name,
            "choices": [{"index": 0, "finish_reason": out.finish_reason,
                         "message": {"role": "assistant", "content": out.text}}],
            "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                      "total_tokens": out.prompt_tokens + out.completion_tokens}})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])
