"""mllm: ablate the architecture choices of modern LLMs, one config switch each."""
from mllm.config import ConfigError, load_config, validate
from mllm.model import Transformer, build_model

__all__ = ['ConfigError', 'Transformer', 'build_model', 'load_config', 'validate']
__version__ = '0.1.0'
