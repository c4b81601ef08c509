"""The base config: every key mllm reads, with its default. Named configs start from it.

    python launch.py --config=configs/base.py:pos=alibi,ffn=geglu,norm=layernorm,placement=post
    python launch.py --config=configs/base.py --config.model.n_layers=2

`arg` is a comma-separated list of choices: the short names pos, ffn, norm, placement, attn, window,
rope_scaling; any dotted path (model.n_layers=2); or any leaf name that is unique (n_kv_heads=2).
"""
from ml_collections import config_dict

from mllm.config import apply_choices

placeholder = config_dict.placeholder


def get_config(arg: str | None = None) -> config_dict.ConfigDict:
  config = config_dict.ConfigDict()
  config.seed = 0

  model = config.model = config_dict.ConfigDict()
  model.vocab_size = 512
  model.d_model = 256
  model.n_layers = 4
  model.n_heads = 8
  model.n_kv_heads = 8  # = n_heads: MHA; 1: MQA; a divisor in between: GQA
  model.head_dim = placeholder(int)  # None: d_model // n_heads
  model.max_seq_len = 256  # context length; size of the learned position table
  model.tie_embeddings = True
  model.dropout = 0.0  # on each residual branch
  model.embed_dropout = 0.0
  model.init_std = 0.02
  model.depth_scaled_init = True  # output projections: init_std / sqrt(2 * n_layers) (GPT-2)
  model.param_dtype = 'float32'
  model.dtype = 'float32'  # compute dtype: float32 | bfloat16
  model.scan_layers = False  # nnx.scan over layers: faster compiles, same results

  attention = model.attention = config_dict.ConfigDict()
  attention.impl = 'xla'
  attention.sliding_window = placeholder(int)  # None: full causal; W: the W most recent keys
  attention.qk_norm = False  # RMSNorm on q and k per head (Qwen3)
  attention.softmax_scale = placeholder(float)  # None: 1 / sqrt(head_dim)
  attention.dropout = 0.0
  attention.use_bias = False  # biases on the q, k, v and output projections (GPT-2)

  position = model.position = config_dict.ConfigDict()
  position.kind = 'rope'  # none | learned | sinusoidal | shaw | t5 | rope | alibi
  position.rope_theta = 10000.0
  position.rope_layout = 'half'  # half (HF/Qwen) | interleaved (paper/Meta)
  position.rope_scaling = 'none'  # none | linear (PI) | ntk | yarn | llama3
  position.rope_scaling_factor = 1.0
  position.rope_original_max_len = placeholder(int)  # None: max_seq_len
  position.yarn_beta_fast = 32.0
  position.yarn_beta_slow = 1.0
  position.llama3_low_freq_factor = 1.0
  position.llama3_high_freq_factor = 4.0
  position.t5_num_buckets = 32
  position.t5_max_distance = 128
  position.shaw_max_distance = 16  # clipping distance k

  ffn = model.ffn = config_dict.ConfigDict()
  ffn.kind = 'swiglu'  # relu | gelu | swish | glu | bilinear | geglu | swiglu | reglu
  ffn.d_ff = placeholder(int)  # None: 4 * d_model
  ffn.match_params = True  # gated FFNs: d_ff * 2/3, so parameters match the ungated FFN
  ffn.multiple_of = 8
  ffn.use_bias = False

  norm = model.norm = config_dict.ConfigDict()
  norm.kind = 'rmsnorm'  # layernorm | rmsnorm | partial_rmsnorm | none
  norm.placement = 'pre'  # pre | post
  norm.eps = 1e-6
  norm.fp32 = True  # statistics in float32 (the notebook's qwen3_compatible)
  norm.use_bias = placeholder(bool)  # None: layernorm True, rmsnorm False (its optional shift)
  norm.partial_p = 0.0625  # partial_rmsnorm: fraction of features in the RMS (paper: 6.25%)
  norm.final_norm = True

  # Filled in by the training issue; present now so configs and overrides keep one shape.
  data = config.data = config_dict.ConfigDict()
  data.seq_len = 256
  data.batch_size = 8

  config.train = config_dict.ConfigDict()
  config.mesh = config_dict.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  return apply_choices(config, arg)
