"""``dynts serve``: transformers' OpenAI-compatible server with continuous batching and eviction.

The app is the one ``transformers serve --continuous-batching`` builds (chat completions and
completions, streaming or not); the model is loaded with :func:`dynts.load` and its
``init_continuous_batching`` returns an :class:`~dynts.serving.manager.EvictingBatchingManager`, so
every request holds at most ``--kv-budget`` KV entries. A thin ASGI layer in front answers bad
requests with HTTP 400 and a clear message (unknown ``kv_method``, a prompt longer than the budget
allows, non-positive ``max_tokens``) before they reach the engine.

Requires the ``serve`` extra (fastapi, uvicorn, openai). Default host: 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import ContinuousBatchingConfig

from ..evictors.base import EVICTORS
from .manager import init_evicting_batching
from ..paged import EvictionSettings, serving_methods

__all__ = ["ServerSettings", "build_app", "main"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
KV_FIELDS = ("kv_method", "kv_budget", "kv_local_window")


@dataclass
class ServerSettings:
    """Where and how the engine serves (the ``--cb-*`` flags of ``transformers serve``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be an int in [0, 65535]")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r} must be a positive int (e.g. 256)")
        for name in ("num_blocks", "max_batch_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or None (sized from free memory)")

    def cb_config(self) -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=self.num_blocks, max_batch_tokens=self.max_batch_tokens
        )


class RequestChecks:
    """ASGI middleware: validates the eviction-relevant fields of completion requests (HTTP 400 on
    bad input) and strips the ``kv_*`` fields the OpenAI handlers do not know."""

    def __init__(self, app, tokenizer, settings: EvictionSettings):
        self.app, self.tokenizer, self.settings = app, tokenizer, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in ENDPOINTS:
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            body = json.loads(raw or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            self.check(scope["path"], body)
        except ValueError as err:
            return await self._reply(send, 400, str(err))
        for name in KV_FIELDS:
            body.pop(name, None)
        raw = json.dumps(body).encode()
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}

        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        return await self.app({**scope, "headers": headers}, replay, send)

    def check(self, path: str, body: dict[str, Any]) -> None:
        """Raise ``ValueError`` with the message the client gets."""
        method = body.get("kv_method")
        if method is not None:
            if method not in EVICTORS:
                raise ValueError(f"kv_method={method!r} is unknown; this server runs {self.settings.evictor.name!r} "
                                 f"(methods that can be served: {serving_methods()})")
            if method != self.settings.evictor.name:
                raise ValueError(f"kv_method={method!r}: this server runs {self.settings.evictor.name!r}; start "
                                 "`dynts serve --kv-method ...` for another method")
        for name, mine in (("kv_budget", self.settings.budget), ("kv_local_window", self.settings.local_window)):
            if body.get(name) is not None and body[name] != mine:
                raise ValueError(f"{name}={body[name]!r}: this server runs {name}={mine}; it is set per server")
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int")
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
            try:
                ids = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                    **(body.get("chat_template_kwargs") or {}),
                )["input_ids"]
            except Exception:  # content parts the template cannot render here: the handler decides
                return
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
            ids = self.tokenizer(prompt)["input_ids"]
        try:
            self.settings.check_prompt(len(ids))
        except ValueError as err:
            raise ValueError(f"the prompt is {len(ids)} tokens: {err}") from None

    @staticmethod
    async def _reply(send, status: int, message: str) -> None:
        payload = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status}}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def build_app(model: torch.nn.Module, tokenizer, settings: EvictionSettings, *, served_name: str,
              cb_config: ContinuousBatchingConfig | None = None):
    """The ASGI app of ``transformers serve --continuous-batching`` serving ``model`` with eviction."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager, TimedModel
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import GenerationState

    def init_continuous_batching(generation_config=None, continuous_batching_config=None, workload_hints=None):
        return init_evicting_batching(model, settings, tokenizer=tokenizer, generation_config=generation_config,
                                      continuous_batching_config=continuous_batching_config or cb_config)

    model.init_continuous_batching = init_continuous_batching  # the CB handler builds its manager through it
    manager = ModelManager(device=str(model.device), dtype="auto", continuous_batching=True, model_timeout=-1)
    key = manager.process_model_name(served_name)
    manager.loaded_models[key] = TimedModel(model, timeout_seconds=-1, processor=tokenizer)
    manager.force_model = served_name
    state = GenerationState(continuous_batching=True, cb_config=cb_config)
    app = build_server(
        manager,
        ChatCompletionHandler(model_manager=manager, generation_state=state),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state,
    )

    @app.exception_handler(ValueError)
    async def _bad_request(_request, exc: ValueError):
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "code": 400}}, 400)

    wrapped = RequestChecks(app, tokenizer, settings)
    wrapped.generation_state = state  # so callers can stop the engine
    return wrapped


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dynts serve", description="OpenAI-compatible server (transformers serve, continuous batching) with a bounded KV cache per request")
    p.add_argument("model", help="local HF directory, smollm2-135m or testbed (dynts.load)")
    p.add_argument("--kv-method", default="dynts", help=f"one of {serving_methods()}")
    p.add_argument("--kv-budget", type=int, default=None, help="B: most KV entries per request")
    p.add_argument("--kv-local-window", type=int, default=None, help="W_l: recent tokens always kept")
    p.add_argument("--kv-retention", type=float, default=0.4, help="fraction of the selection window kept")
    p.add_argument("--predictor", default=None, help="DynTS predictor directory (needed by --kv-method dynts)")
    p.add_argument("--think-end", default="</think>", help="token closing the thinking segment")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--device", default="cpu")
    p.add_argument("--served-name", default=None, help="model name clients send (default: MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--page-size", type=int, default=256, help="KV tokens per block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks in the pool (default: sized from memory)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="most tokens per forward")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    try:
        settings = EvictionSettings(args.kv_method, args.kv_budget, args.kv_local_window, args.kv_retention,
                                    args.predictor, args.think_end)
        server = ServerSettings(args.host, args.port, args.page_size, args.num_blocks, args.max_batch_tokens,
                                args.log_level)
    except ValueError as err:
        raise SystemExit(f"dynts serve: {err}")
    import uvicorn

    from .. import load

    model, tokenizer = load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    app = build_app(model, tokenizer, settings, served_name=args.served_name or args.model,
                    cb_config=server.cb_config())
    print(f"dynts serve: {args.served_name or args.model} with {settings.evictor.name} "
          f"(budget={settings.budget}, local_window={settings.local_window}) on http://{server.host}:{server.port}/v1",
          flush=True)
    try:
        uvicorn.run(app, host=server.host, port=server.port, log_level=server.log_level)
    finally:
        app.generation_state.shutdown()
    return 0
