"""mllm: ablate the architecture choices of modern LLMs, one config switch each."""

from mllm.accounting import count_params, training_flops_per_token
from mllm.config import ConfigError, load_config

# `mllm.generate(model, tokenizer, prompts, ...)`: the function; the package mllm/generation/ holds
# the rest (sampling, the decode loop, loading a run).
from mllm.generation import generate, generate_tokens, load_run
from mllm.interop.hf import from_hf, to_hf
from mllm.model import Transformer, build_model
from mllm.validation import validate

__all__ = [
  'ConfigError',
  'Transformer',
  'build_model',
  'count_params',
  'from_hf',
  'generate',
  'generate_tokens',
  'load_config',
  'load_run',
  'to_hf',
  'training_flops_per_token',
  'validate',
]
__version__ = '0.1.0'
