"""Where the plugin meets vLLM: wrappers around a handful of scheduler and model-runner methods.

An engine started without ``additional_config={"dynts": {...}}`` runs stock: the class-level wrappers run
once per engine (construction) or once per request (the ``dynts`` fields check), and the per-step wrappers
(``schedule``, ``execute_model``, ...) are bound only on the scheduler, runner and output processor of an
engine that asked for dynts (:func:`dynts.vllm.wrapping.bind`). The methods wrapped (checked to exist by
:func:`dynts.vllm.compat.missing_internals`):

| process | method | what dynts adds |
|---|---|---|
| front end | ``EngineArgs.create_engine_config`` | refuses configurations it has not been tested with (:mod:`dynts.vllm.checks`), before any model load |
| engine core | ``Scheduler.__init__`` | builds :class:`~dynts.vllm.scheduler.SchedulerHooks`; the same refusals (an engine core started on its own); binds the three below |
| engine core | ``Scheduler.schedule`` (bound) | eviction events and freed blocks before the round, admission by bounded footprint, the plan on the output |
| engine core | ``Scheduler._preempt_request`` (bound) | a preempted evicted request fails loudly |
| engine core | ``Scheduler.update_from_output`` (bound) | requests a worker failed (``ModelRunnerOutput.dynts_faults``) finish with ``finish_reason="error"``, one log line each; the engine goes on |
| engine core | ``Scheduler._free_request`` (bound) | per-request state is dropped; its statistics join the request's ``kv_transfer_params`` (:mod:`dynts.vllm.metrics`) |
| engine core | ``KVCacheManager.allocate_slots`` (per instance) | blocks follow ``stored = num_computed_tokens - shift`` |
| engine core | ``KVCacheCoordinator.cache_blocks``, ``.find_longest_cache_hit``, ``KVCacheManager.get_computed_blocks``, ``.prefix_cache_lookup_enabled`` (per instance) | only blocks inside the request's own protected prefix are hashed, shared and reused |
| front end | ``InputProcessor.__init__`` | a dynts engine: the ``dynts_*`` Prometheus counters and the response wrappers below |
| front end | ``InputProcessor.process_inputs`` | per-request ``dynts`` fields and the prompt checked against the budget, a ``prompt_embeds`` or streaming-input request refused (HTTP 400, :func:`~dynts.vllm.checks.request_problem`); an engine without dynts refuses a request with ``dynts`` fields (HTTP 400) |
| front end | ``OutputProcessor.process_outputs`` (installed with the first dynts front end) | finished requests' statistics counted; ``n > 1`` children's merged |
| front end | ``OpenAIServingCompletion.request_output_to_completion_response``, ``OpenAIServingChat.chat_completion_full_generator`` | ``usage.dynts`` |
| worker | the model runner's methods | :mod:`dynts.vllm.runners` (one table per runner: V1 on vLLM 0.32, V2 on 0.34) |
"""

from __future__ import annotations

from typing import Any

from .checks import check_engine, request_problem
from .compat import runner_of
from .config import PluginConfig, asks_for_dynts
from .metrics import Counters, attach, move_to_usage, pass_on, request_stats
from .refusals import refuse_request
from .runners import install_runner
from .scheduler import SchedulerHooks
from .wrapping import bind, wrap

__all__ = ["check_engine", "install"]

_INSTALLED = False
_RESPONSES = False
_COUNTERS: Counters | None = None  # the front end of a dynts engine in this process
NOT_CONFIGURED = ("this engine evicts nothing: it was started without additional_config['dynts']; drop the request's "
                  "dynts fields, or start vLLM with --additional-config '{\"dynts\": {...}}'")


def _install_scheduler() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            config = PluginConfig.from_vllm(self.vllm_config)
            self._dynts = None
            if config is None:
                return
            check_engine(self.vllm_config)
            hooks = SchedulerHooks(self, config, ship_token_ids=runner_of() == "v2")
            self._dynts = hooks
            manager = self.kv_cache_manager
            allocate, cache, lookup = manager.allocate_slots, manager.coordinator.cache_blocks, manager.prefix_cache_lookup_enabled
            computed, find = manager.get_computed_blocks, manager.coordinator.find_longest_cache_hit
            hit_limit: list[int | None] = [None]  # the protected prefix of the request being looked up

            def allocate_slots(request, *a, **k):
                shift = hooks.shift(request)
                if not shift:
                    return allocate(request, *a, **k)
                request.num_computed_tokens -= shift
                try:
                    return allocate(request, *a, **k)
                finally:
                    request.num_computed_tokens += shift

            def cache_blocks(request, num_computed_tokens):
                limit = hooks.cache_limit(request)
                return cache(request, num_computed_tokens if limit is None else min(num_computed_tokens, limit))

            def prefix_cache_lookup_enabled(request):
                limit = hooks.cache_limit(request)
                return lookup(request) and (limit is None or limit >= hooks.block_size)

            def get_computed_blocks(request, *a, **k):
                hit_limit[0] = hooks.cache_limit(request)
                try:
                    return computed(request, *a, **k)
                finally:
                    hit_limit[0] = None

            def find_longest_cache_hit(block_hashes, max_cache_hit_length, *a, **k):
                limit = hit_limit[0]  # a hit never reaches past the prefix this request keeps in place
                return find(block_hashes, max_cache_hit_length if limit is None else min(max_cache_hit_length, limit),
                            *a, **k)

            manager.allocate_slots = allocate_slots
            manager.get_computed_blocks = get_computed_blocks
            manager.coordinator.find_longest_cache_hit = find_longest_cache_hit
            manager.coordinator.cache_blocks = cache_blocks
            manager.prefix_cache_lookup_enabled = prefix_cache_lookup_enabled
            bind(self, "schedule", schedule)
            bind(self, "_preempt_request", preempt)
            bind(self, "_free_request", free)
            bind(self, "update_from_output", update)
        return __init__

    def schedule(original):
        def wrapped(self, *args, **kwargs):
            hooks = self._dynts
            plan = hooks.before_schedule()
            waiting = list(self.waiting)
            hidden = waiting[hooks.admissible(waiting):]
            if hidden:
                self.waiting.remove_requests(hidden)
            try:
                output = original(self, *args, **kwargs)
            finally:
                for request in hidden:
                    self.waiting.add_request(request)
            hooks.after_schedule(output, plan)
            return output
        return wrapped

    def preempt(original):
        def _preempt_request(self, request, *args, **kwargs):
            original(self, request, *args, **kwargs)
            self._dynts.on_preempt(request)
        return _preempt_request

    def update(original):
        def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
            faults = getattr(model_runner_output, "dynts_faults", None)
            if faults:  # requests a worker failed this round: finished with an error by this very call
                self._dynts.fail(faults)
            return original(self, scheduler_output, model_runner_output, *args, **kwargs)
        return update_from_output

    def free(original):
        def _free_request(self, request, *args, **kwargs):
            kv_transfer_params, ec_transfer_params = original(self, request, *args, **kwargs)
            return attach(kv_transfer_params, self._dynts.forget(request.request_id)), ec_transfer_params
        return _free_request

    wrap(Scheduler, "__init__", init)


def _install_frontend() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    def init(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self._dynts_config = PluginConfig.from_vllm(self.vllm_config)
            if self._dynts_config is not None:
                _serve_statistics(self.vllm_config)
        return __init__

    def process(original):
        def process_inputs(self, *args, **kwargs):
            request = original(self, *args, **kwargs)
            config = getattr(self, "_dynts_config", None)
            params = getattr(request, "sampling_params", None)
            if params is None:
                return request
            if config is not None:
                problem = request_problem(request)
                if problem is not None:
                    raise refuse_request(problem)
                check_request(config, params.extra_args, len(request.prompt_token_ids or ()))
            elif asks_for_dynts(params.extra_args):
                raise refuse_request(NOT_CONFIGURED)
            return request
        return process_inputs

    def create(original):
        def create_engine_config(self, *args, **kwargs):
            vllm_config = original(self, *args, **kwargs)
            if PluginConfig.from_vllm(vllm_config) is not None:
                check_engine(vllm_config)  # in the front end, before any process starts or any weight loads
            return vllm_config
        return create_engine_config

    wrap(EngineArgs, "create_engine_config", create)
    wrap(InputProcessor, "__init__", init)
    wrap(InputProcessor, "process_inputs", process)


def _serve_statistics(vllm_config: Any) -> None:
    """A dynts engine's front end: the Prometheus counters of its model, its finished requests counted,
    ``usage.dynts`` in responses."""
    global _COUNTERS
    name = vllm_config.model_config.served_model_name
    _COUNTERS = Counters(name[0] if isinstance(name, (list, tuple)) else str(name))
    _install_responses()


def _install_responses() -> None:
    """Finished requests' statistics counted, ``usage.dynts`` in the non-streaming completion and chat
    responses (once per process, with its first dynts front end)."""
    global _RESPONSES
    if _RESPONSES:
        return
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    def outputs(original):
        def process_outputs(self, engine_core_outputs, *args, **kwargs):
            for output in engine_core_outputs:
                state = self.request_states.get(output.request_id)
                if output.finish_reason is None or state is None:  # running, or aborted already
                    continue
                _COUNTERS.finished(request_stats(output.kv_transfer_params),
                                   failed=output.finish_reason == FinishReason.ERROR)
                if state.parent_req is not None:
                    pass_on(state.parent_req, output)
            return original(self, engine_core_outputs, *args, **kwargs)
        return process_outputs

    def completion(original):
        def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
            return move_to_usage(original(self, final_res_batch, *args, **kwargs), final_res_batch)
        return request_output_to_completion_response

    def chat(original):
        async def chat_completion_full_generator(self, *args, **kwargs):
            response = await original(self, *args, **kwargs)
            return move_to_usage(response, [response])  # it carries its final output's kv_transfer_params
        return chat_completion_full_generator

    wrap(OutputProcessor, "process_outputs", outputs)
    wrap(OpenAIServingCompletion, "request_output_to_completion_response", completion)
    wrap(OpenAIServingChat, "chat_completion_full_generator", chat)
    _RESPONSES = True


def check_request(config: PluginConfig, extra_args: Any, prompt_length: int) -> None:
    """Raise vLLM's validation error (HTTP 400) for bad per-request dynts fields or a prompt the budget
    cannot hold next to the local window."""
    try:
        settings = config.for_request(extra_args)
        settings.check_prompt(prompt_length)
    except ValueError as err:
        raise refuse_request(str(err)) from None


def install() -> None:
    """Install every wrapper once per process (vLLM calls the plugin in each of its processes)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _install_scheduler()
    _install_frontend()
    install_runner(runner_of())
    _INSTALLED = True
