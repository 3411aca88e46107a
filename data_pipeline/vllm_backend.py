"""Optional vLLM backend for trace generation (``backend: vllm``), for users with GPUs.

Same work items (:class:`~data_pipeline.questions.QuestionDataModule`), same record logic (the
``make_record`` that :func:`data_pipeline.traces.generate_traces` passes in, so this module never
imports ``traces``) and same atomic shards as the Lightning backend; vLLM schedules each chunk of
``shard_size`` prompts itself (continuous batching). The ``vllm.LLM`` settings come from the trace
config: ``tensor_parallel_size``, ``max_model_len`` (default: the longest prompt + ``max_new_tokens``)
and ``gpu_memory_utilization``. Sampling follows :func:`sampling_settings` (HF's ``top_k=0`` "off" is
vLLM's ``-1``). ``vllm`` is imported only here, only when selected.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["llm_settings", "run_vllm", "sampling_settings"]

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
    """Keyword arguments of ``vllm.LLM`` for a trace config (``TraceConfig``) and its prompts."""
    longest = max((len(p) for p in prompts), default=0)
    return {
        "model": _model_path(config.model),
        "dtype": config.dtype,
        "seed": config.seed,
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_model_len": config.max_model_len or longest + config.max_new_tokens,
        "gpu_memory_utilization": config.gpu_memory_utilization,
    }


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
    llm = vllm.LLM(**llm_settings(config, pending))
    grader = make_grader(config.grader)
    items = data.items
    for start in range(0, len(items), config.shard_size):
        chunk = items[start : start + config.shard_size]
        params = [
            vllm.SamplingParams(**sampling_settings(config, config.seed + 7919 * it.question_index + it.sample_id))
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
