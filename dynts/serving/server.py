"""``dynts serve``: an OpenAI-compatible server over transformers' continuous batching with eviction.

Endpoints: ``POST /v1/completions`` and ``/v1/chat/completions`` (streaming or not, ``n`` choices,
list prompts), ``GET /v1/models``, ``/health`` and ``/metrics`` (Prometheus text,
:mod:`dynts.metrics`). Bodies are checked by :mod:`dynts.serving.openai_api` (4xx, never a
500), prompts are tokenized in a worker thread and admitted by :class:`~dynts.serving.admission.Limits`
(a request that can never fit gets 400 at once). Each request samples with its own parameters
(:mod:`dynts.serving.sampling`) and stops at its own ``stop`` strings; a request whose client
disconnects is cancelled and its blocks go back to the pool. Every response's ``usage`` carries a
``dynts`` object (peak slots, evictions, evicted tokens, freed blocks).

Requires the ``serve`` extra (starlette via fastapi, uvicorn). Default host: 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import ContinuousBatchingConfig

from ..cli_options import add_load_arguments, load_kwargs
from .admission import Limits, default_max_tokens
from .manager import EvictingBatchingManager, init_evicting_batching
from ..metrics import ServerCounters, render_prometheus
from .openai_api import BadRequest, error_body
from .pool import plan_pool
from ..core import EvictionSettings, add_eviction_arguments, eviction_spec
from .streams import Choice, Completion

__all__ = ["ServerSettings", "Server", "build_app", "main"]

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """Where and how the engine serves."""

    host: str = "127.0.0.1"
    port: int = 8000
    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_tokens: int | None = None
    log_level: str = "warning"

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be an int in [0, 65535]")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r} must be a positive int (e.g. 256)")
        for name in ("num_blocks", "max_batch_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or None (the default)")

    def cb_config(self, num_blocks: int | None = None) -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(page_size=self.page_size, num_blocks=num_blocks or self.num_blocks,
                                        max_batch_tokens=self.max_batch_tokens)


class Server:
    """One engine behind the OpenAI endpoints: admission, submission, cancellation, statistics."""

    def __init__(self, manager: EvictingBatchingManager, tokenizer, settings: EvictionSettings, limits: Limits,
                 served_name: str) -> None:
        self.manager, self.tokenizer, self.settings, self.limits = manager, tokenizer, settings, limits
        self.served_name = served_name
        self.counters = ServerCounters()
        config = manager.model.config.get_text_config()
        self.vocab_size = int(config.vocab_size)

    # ----------------------------------------------------------------- engine
    def submit(self, choice: Choice, prompt: list[int], max_new_tokens: int, *, ignore_eos: bool) -> None:
        """Queue one choice's engine request; its outputs reach ``choice`` on this event loop."""
        self.manager.register_result_handler(choice.request_id, choice.on_output)
        queued = self.manager.add_request(prompt, request_id=choice.request_id, max_new_tokens=max_new_tokens,
                                          streaming=True, eos_token_id=-1 if ignore_eos else None,
                                          sampling=choice.sampling)
        if queued is None:
            self.manager.output_router.result_handlers.pop(choice.request_id, None)
            raise RuntimeError("the engine is not accepting requests (stopping)")

    def cancel(self, choice: Choice) -> None:
        """Cancel an unfinished engine request (its blocks return to the pool at the next round)."""
        self.manager.cancel_request(choice.request_id)
        self.manager.output_router.result_handlers.pop(choice.request_id, None)
        self.counters.add(requests_cancelled=1)

    def finish(self, choices: list[Choice]) -> list[dict[str, int]]:
        """Per-request statistics of finished choices; the engine forgets them."""
        stats = []
        for choice in choices:
            s = self.manager.request_stats(choice.request_id)
            self.manager.release(choice.request_id)
            stats.append(s)
            self.counters.add(requests=1, requests_failed=int(choice.error is not None),
                              **{k: s.get(k, 0) for k in ("evictions", "evicted_tokens", "freed_blocks")})
        return stats

    def alive(self) -> bool:
        return self.manager.is_running() and self.manager.background_thread_status.fatal_error is None

    def stats(self) -> dict[str, float]:
        """The engine's state and the server's counters, keyed by :data:`dynts.metrics.METRICS`."""
        out: dict[str, float] = dict(self.counters.snapshot())
        p = self.manager.last_processor
        if p is not None:
            free = p.free_blocks_in_pool()  # pool counters: safe to read from another thread
            in_use = p.allocator.num_blocks - free
            out.update(
                requests_running=len(p.scheduler.active_requests),
                requests_waiting=len(p.scheduler.waiting_requests) + self.manager.input_queue.qsize(),
                kv_blocks=p.allocator.num_blocks, kv_blocks_in_use=in_use,
                kv_blocks_free=free, kv_block_tokens=p.page, preemptions=p.policy.preemptions,
            )
        return out


def build_app(server: Server):
    """The Starlette app serving ``server``."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from .openai_api import MAX_BODY_BYTES, encode, parse_body, parse_request

    def refuse(err: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(err), err.status, err.param), err.status)

    async def read_body(request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise BadRequest(f"the request body is over this server's limit of {MAX_BODY_BYTES} bytes", 413)
            chunks.append(chunk)
        return b"".join(chunks)

    async def complete(request, chat: bool):
        try:
            body = parse_body(await read_body(request))
            req = parse_request(body, chat=chat, settings=server.settings,
                                default_sampling=server.manager.default_sampling)
            prompts = await run_in_threadpool(encode, server.tokenizer, req, server.vocab_size)
            budgets = [server.limits.admit(len(p), req.max_tokens) for p in prompts]
        except ClientDisconnect:
            return PlainTextResponse("", 499)
        except (BadRequest, ValueError) as err:  # AdmissionError is a ValueError
            return refuse(err if isinstance(err, BadRequest) else BadRequest(str(err)))
        if not server.alive():
            return JSONResponse(error_body("the engine is not running", 503), 503)
        completion = Completion(req, model=req.model or server.served_name, tokenizer=server.tokenizer,
                                prompt_lengths=[len(p) for p in prompts], max_new_tokens=budgets,
                                counters=server.counters)
        try:
            for choice in completion.choices:
                server.submit(choice, prompts[choice.prompt_index], budgets[choice.prompt_index],
                              ignore_eos=req.ignore_eos)
        except RuntimeError as err:
            settle(completion)
            return JSONResponse(error_body(str(err), 503), 503)
        server.counters.add(prompt_tokens=sum(completion.prompt_lengths))
        if req.stream:
            return StreamingResponse(stream(completion), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while not completion.done:
                await completion.wait(0.25)
                if not completion.done and await request.is_disconnected():
                    return PlainTextResponse("", 499)
        finally:
            settle(completion)
        if completion.error is not None:
            return JSONResponse(error_body(f"generation failed: {completion.error}", 500), 500)
        return JSONResponse(completion.response())

    def settle(completion: Completion) -> None:
        """Cancel what is still running (client gone, stop string) and collect the statistics."""
        for choice in completion.choices:
            if not choice.engine_done:
                server.cancel(choice)
        completion.stats = server.finish(completion.choices)

    async def stream(completion: Completion):
        try:
            while True:
                for chunk in completion.drain_chunks():
                    yield f"data: {json.dumps(chunk)}\n\n"
                if completion.done:
                    break
                await completion.wait(None)
            settle(completion)
            if completion.error is not None:
                yield f"data: {json.dumps(error_body(f'generation failed: {completion.error}', 500))}\n\n"
            elif completion.request.include_usage:
                yield f"data: {json.dumps(completion.usage_chunk())}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client left mid-stream: the generator is closed here
            if completion.stats is None:
                settle(completion)

    async def completions(request):
        return await complete(request, chat=False)

    async def chat_completions(request):
        return await complete(request, chat=True)

    async def models(_request):
        return JSONResponse({"object": "list", "data": [
            {"id": server.served_name, "object": "model", "created": 0, "owned_by": "dynts"}]})

    async def health(_request):
        ok = server.alive()
        return JSONResponse({"status": "ok" if ok else "engine stopped"}, 200 if ok else 503)

    async def metrics(_request):
        return PlainTextResponse(render_prometheus(server.stats(), {"model": server.served_name}),
                                 media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes)


def start_server(model: torch.nn.Module, tokenizer, settings: EvictionSettings, server_settings: ServerSettings, *,
                 served_name: str, startup_timeout: float = 600.0) -> tuple[Server, str]:
    """Build and start the engine (its KV pool allocated now, so a pool that does not fit fails here) and
    return the server and a line saying how the pool was sized."""
    num_blocks = server_settings.num_blocks
    if num_blocks is None:
        plan = plan_pool(model, settings, server_settings.page_size)
        num_blocks, pool_line = plan.num_blocks, plan.describe()
    else:
        pool_line = f"KV pool {num_blocks} blocks x {server_settings.page_size} tokens: --num-blocks"
    manager = init_evicting_batching(model, settings, tokenizer=tokenizer, per_request_sampling=True,
                                     continuous_batching_config=server_settings.cb_config(num_blocks))
    manager.start()
    deadline = time.monotonic() + startup_timeout
    while manager.last_processor is None:
        fatal = manager.background_thread_status.fatal_error
        if fatal is not None or not manager.is_running():
            manager.stop(block=True, timeout=30)
            raise RuntimeError(f"the engine could not start with {pool_line}: {fatal or 'engine thread exited'}; "
                               "pass a smaller --num-blocks (or --max-batch-tokens)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not start within {startup_timeout:.0f} s")
        time.sleep(0.05)
    processor = manager.last_processor
    config = model.config.get_text_config()
    max_positions = getattr(config, "max_position_embeddings", None)
    limits = Limits(settings, processor.allocator.num_blocks, processor.page, max_positions,
                    server_settings.max_tokens or default_max_tokens(settings, max_positions))
    return Server(manager, tokenizer, settings, limits, served_name), pool_line


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dynts serve", description="OpenAI-compatible server (continuous batching) with "
                                "a bounded KV cache per request")
    p.add_argument("model", help="local HF directory, smollm2-135m or testbed (dynts.load)")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="transformers' continuous batching (this server) or vLLM's OpenAI server with the dynts plugin")
    add_eviction_arguments(p)
    p.add_argument("--think-end", default="</think>", help="token closing the thinking segment")
    add_load_arguments(p)
    p.add_argument("--served-name", default=None, help="model name in /v1/models (default: MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--page-size", type=int, default=256, help="KV tokens per block")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: sized from the memory free on the device, dynts.serving.pool)")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="most tokens per forward")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap on generated tokens per request (default: the model's context for full, 32768 evicting)")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def resolve_device(args: argparse.Namespace) -> dict[str, Any]:
    """``dynts.load`` keywords for one device: ``--device`` (default cuda when present); ``--device-map`` is refused."""
    options = load_kwargs(args)
    if options.pop("device_map") is not None:
        raise ValueError(f"--device-map {args.device_map}: dynts serve runs continuous batching on one device; "
                         "use --device cuda:N (one GPU) instead, or dynts.generate for a model sharded over GPUs")
    if options["device"] is None:
        options["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(argv or []))
    try:
        settings = eviction_spec(args, think_end=args.think_end).build().check_served()
        server_settings = ServerSettings(args.host, args.port, args.page_size, args.num_blocks, args.max_batch_tokens,
                                         args.max_tokens, args.log_level)
        options = resolve_device(args)
    except ValueError as err:
        raise SystemExit(f"dynts serve: {err}")
    import uvicorn

    from ..models import load

    model, tokenizer = load(args.model, **options)
    name = args.served_name or args.model
    try:
        server, pool_line = start_server(model, tokenizer, settings, server_settings, served_name=name)
    except (MemoryError, RuntimeError) as err:
        raise SystemExit(f"dynts serve: {err}")
    print(f"dynts serve: {name} with {settings.evictor.name} (budget={settings.budget}, "
          f"local_window={settings.local_window}) on {options['device']}, {pool_line}; max_tokens cap "
          f"{server.limits.max_tokens}; http://{server_settings.host}:{server_settings.port}/v1", flush=True)
    try:
        uvicorn.run(build_app(server), host=server_settings.host, port=server_settings.port,
                    log_level=server_settings.log_level)
    finally:
        server.manager.stop(block=True, timeout=30)
    return 0
