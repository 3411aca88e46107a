"""Patch vLLM 0.34's ``vllm/vllm_flash_attn/__init__.py`` (stdin -> stdout) for the carry bundle.

The module raises at import when neither the FA2 nor the FA3 binary is present, and vLLM's CUDA platform imports it
while choosing an attention backend. The bundle carries neither binary and runs TRITON_ATTN, so instead of raising at
import the module's kernel entry points (``flash_attn_varlen_func``, ``get_scheduler_metadata``) raise when called,
saying so: an engine on FLASH_ATTN (vLLM's own choice on an H200 when no backend is named) stops at its first
forward with that message instead of failing somewhere inside a missing op. Exits non-zero if the guard is not
there exactly once (a vLLM change).
"""

import re
import sys

# The guard: `if not (FA2_AVAILABLE or FA3_AVAILABLE):` and its `raise ImportError(...)` statement.
GUARD = re.compile(r"if not \(FA2_AVAILABLE or FA3_AVAILABLE\):\n    raise ImportError\(\n(?:        .*\n)+    \)\n")
PATCHED = """if not (FA2_AVAILABLE or FA3_AVAILABLE):  # the vLLM GPU carry bundle: no FA2/FA3 binaries

    def _refuse_flash_attention(*args, **kwargs):
        raise RuntimeError(
            "FLASH_ATTN is not in the vLLM GPU carry bundle (it has no FA2/FA3 binaries): start the engine "
            "with attention_backend='TRITON_ATTN' (--attention-backend TRITON_ATTN), or install vLLM's CUDA wheel")

    flash_attn_varlen_func = get_scheduler_metadata = _refuse_flash_attention
"""

source = sys.stdin.read()
found = len(GUARD.findall(source))
if found != 1:
    sys.exit(f"patch_flash_attn: expected FlashAttention's import guard once, found it {found} times (a vLLM change)")
sys.stdout.write(GUARD.sub(lambda m: PATCHED, source))
