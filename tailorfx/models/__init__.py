"""Small reference models built from configs, for tests, demos and benchmarks."""
from tailorfx.models.llama import LlamaConfig, LlamaLM, CausalLMOutput

__all__ = ["LlamaConfig", "LlamaLM", "CausalLMOutput"]
