"""Serving on the runtime: vLLM's offline interface (``LLM``, ``SamplingParams``) over one HybridModel."""
from jax_gdn.serving.llm import FINISH_REASONS, LLM, CompletionOutput, RequestOutput
from jax_gdn.serving.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "FINISH_REASONS"]
