"""mllm: ablate the architecture choices of modern LLMs, one config switch each."""
from mllm.accounting import count_params, training_flops_per_token
from mllm.config import ConfigError, load_config, validate
from mllm.model import Transformer, build_model

__all__ = ['ConfigError', 'Transformer', 'build_model', 'count_params', 'load_config',
           'training_flops_per_token', 'validate']
__version__ = '0.1.0'
