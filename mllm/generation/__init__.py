"""Autoregressive generation: sampling.py (next-token sampling), decode.py (`generate_tokens`:
batched prefill, then one jitted decode loop over the KV cache), text.py (`generate`: text in,
text out; `load_run`: a trained workdir's model and tokenizer)."""

from mllm.generation.decode import generate_tokens
from mllm.generation.sampling import sample
from mllm.generation.text import TextStream, generate, load_run

__all__ = ['TextStream', 'generate', 'generate_tokens', 'load_run', 'sample']
