"""mllm: ablate the architecture choices of modern LLMs, one config switch each."""

import importlib

# The top-level names, each imported when first used (PEP 562): `import mllm` (and launch.py's
# one-line errors for a bad config) then costs no Orbax, Grain or generation import.
# `mllm.generate(model, tokenizer, prompts, ...)` is the function; the package mllm/generation/
# holds the rest (sampling, the decode loop, loading a run).
_WHERE = {
  'ConfigError': 'mllm.config',
  'Transformer': 'mllm.model',
  'build_model': 'mllm.model',
  'count_params': 'mllm.accounting',
  'from_hf': 'mllm.interop.hf',
  'generate': 'mllm.generation',
  'generate_tokens': 'mllm.generation',
  'load_config': 'mllm.config',
  'load_run': 'mllm.generation',
  'to_hf': 'mllm.interop.hf',
  'training_flops_per_token': 'mllm.accounting',
  'validate': 'mllm.validation',
}
__all__ = sorted(_WHERE)
__version__ = '0.1.0'


def __getattr__(name: str):
  if name in _WHERE:
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value
  try:  # a subpackage, as `import mllm; mllm.validation.validate(...)` found it when eager
    return importlib.import_module(f'{__name__}.{name}')
  except ModuleNotFoundError as e:
    if e.name != f'{__name__}.{name}':
      raise
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted([*globals(), *_WHERE])
