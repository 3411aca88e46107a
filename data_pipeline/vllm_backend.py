"""Optional vLLM backend for trace generation (``backend: vllm``), for users with GPUs.

Same work items (:class:`~data_pipeline.questions.QuestionDataModule`), same record logic
(:func:`~data_pipeline.traces.make_record`) and same atomic shards as the Lightning backend; vLLM
schedules each chunk of ``shard_size`` prompts itself (continuous batching, tensor parallelism
through ``vllm.LLM`` settings). ``vllm`` is imported only here, only when selected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from data_pipeline.questions import QuestionDataModule
    from data_pipeline.traces import ShardWriter, TraceConfig

__all__ = ["run_vllm"]


def _vllm():
    try:
        import vllm
    except ImportError as err:
        raise ValueError("backend='vllm' needs vLLM installed (pip install vllm, on a GPU machine); or use backend='hf'") from err
    return vllm


def _model_path(name: str) -> str:
    from data_pipeline.loading import model_path

    return str(model_path(name))


def run_vllm(config: "TraceConfig", data: "QuestionDataModule", writer: "ShardWriter", tokenizer) -> None:
    """Sample every pending item of ``data`` with vLLM and hand the results to ``writer``."""
    from data_pipeline.grading import make_grader
    from data_pipeline.traces import make_record

    vllm = _vllm()
    llm = vllm.LLM(model=_model_path(config.model), dtype=config.dtype, seed=config.seed)
    grader = make_grader(config.grader)
    items = data.items
    for start in range(0, len(items), config.shard_size):
        chunk = items[start : start + config.shard_size]
        params = [
            vllm.SamplingParams(
                temperature=config.temperature,
                top_p=config.top_p,
                top_k=config.top_k,
                max_tokens=config.max_new_tokens,
                seed=config.seed + 7919 * it.question_index + it.sample_id,
            )
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
