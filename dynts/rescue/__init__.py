"""KV-Rescue (Cheong et al.): recover what KV eviction loses by interleaving, step by step, an
evicted base model with a small full-context helper, chosen by a process reward model, with an
online detector that aborts degenerate base candidates. Any registered evictor (DynTS included)
can be the base's.

    from dynts.rescue import RescueConfig, rescue_generate
    out = rescue_generate(base, helper, "testbed-prm", tokenizer, prompts, method="dynts",
                          budget=64, local_window=16, predictor="checkpoints/testbed-predictor",
                          config=RescueConfig(n_base=4, n_helper=4, step_delimiter=";"))
"""

from .config import RescueConfig
from .detector import CandidateScreen, DegenerationDetector, gzip_ratio
from .interleave import delimiter_token_ids, rescue_generate
from .likelihood import LikelihoodPRM
from .loops import StepHistory, StepLoopDetector
from .results import ProblemResult, RescueResult, Step, summarize
from .prm import CallablePRM, QwenMathPRM, StepRequest, StepScorer, TokenClassificationPRM, load_prm
from .scorer import ProductPRM
from .rows import RaggedCache
from .sampling import Sampler, candidate_generator

__all__ = [
    "CallablePRM",
    "CandidateScreen",
    "DegenerationDetector",
    "LikelihoodPRM",
    "ProblemResult",
    "ProductPRM",
    "QwenMathPRM",
    "RaggedCache",
    "RescueConfig",
    "RescueResult",
    "Sampler",
    "Step",
    "StepHistory",
    "StepLoopDetector",
    "StepRequest",
    "StepScorer",
    "TokenClassificationPRM",
    "candidate_generator",
    "delimiter_token_ids",
    "gzip_ratio",
    "load_prm",
    "rescue_generate",
    "summarize",
]
