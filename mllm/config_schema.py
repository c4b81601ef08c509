"""The schema: every config key mllm reads, with its default and a comment on what it does.

configs/base.py re-exports this `get_config`, and every named config starts from it:

    python launch.py --config=configs/base.py:pos=alibi,ffn=geglu,norm=layernorm,placement=post

`arg` is a comma-separated list of choices: the short names pos, ffn, norm, placement, attn, window,
rope_scaling, opt, param; any dotted path (model.n_layers=2); or any leaf name or tail of a path that is unique
(n_kv_heads=2, t5.num_buckets=64).
It lives in the library (not in configs/) because the library builds configs from it too: a Hugging
Face import or export maps a checkpoint's config.json onto these defaults.
"""

from ml_collections import config_dict

from mllm.config_keys import apply_choices, get_path, set_path
from mllm.layers.attention import ATTENTIONS
from mllm.layers.ffn import FFNS
from mllm.layers.norms import NORMS
from mllm.layers.parametrization import PARAMETRIZATIONS
from mllm.layers.positions import POSITIONS
from mllm.optimizers import OPTIMIZERS
from mllm.variant_config import add_sections, keys_of, reset_unread

placeholder = config_dict.placeholder


# One function of ~150 lines on purpose: it is the schema, every key and its default in one
# listing that a reader scans top to bottom (as ml_collections configs are written).
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
  # Gemma 2's final-logit soft-capping: logits → cap · tanh(logits / cap); None: off
  model.final_logit_softcap = placeholder(float)
  model.dropout = 0.0  # on each residual branch
  model.embed_dropout = 0.0
  # Initialisation scheme (mllm/layers/parametrization.py): fan_in (1/sqrt(fan_in), LeCun) | fixed
  # (N(0, init_std) for every weight, GPT-2) | small_init (sqrt(2 / (5 d_model)), Nguyen & Salazar
  # 2019). fixed's 0.02 suits d_model ~768; at d_model 128 it cost a GELU model 0.2 nats at its
  # tuned lr (experiments/results/init_gelu), hence fan_in by default.
  model.init = 'fan_in'
  model.init_std = 0.02  # read only by init='fixed'
  model.embed_scale = 1.0  # token embeddings × this, before positions (Vaswani 2017 §3.4: √d_model)
  model.depth_scaled_init = (
    True  # output projections: the scheme's std / sqrt(2 * n_layers) (GPT-2)
  )
  model.param_dtype = 'float32'
  model.dtype = 'float32'  # compute dtype: float32 | bfloat16
  model.scan_layers = False  # jax.lax.scan over stacked layers: faster compiles, same results
  # One multi-token-prediction depth beside the head (DeepSeek-V3): t_{i+2} from h_i and t_{i+1}
  model.multi_token_prediction = False
  model.scan_unroll = 1  # with scan_layers: layers per loop iteration (XLA fuses across them;
  # with a per-layer pattern, whole periods of it)
  model.remat = 'none'  # none | full (recompute each layer in the backward) | dots (keep matmuls)
  # standard | mup (µP, Tensor Programs V: init, per-layer rates, attention scale and logits scaled
  # with d_model / mup.base_d_model, so a rate tuned at the base width transfers; parametrization.py)
  model.parametrization = config_dict.ConfigDict({'kind': 'standard'})
  add_sections(model.parametrization, PARAMETRIZATIONS)

  attention = model.attention = config_dict.ConfigDict()
  # mha: n_kv_heads key/value heads (MHA, GQA, MQA) | mla: multi-head latent attention (DeepSeek-V2),
  # its section attention.mla {kv_lora_rank, q_lora_rank, rope_head_dim, v_head_dim}
  attention.kind = 'mha'
  add_sections(attention, ATTENTIONS)
  attention.impl = (
    'auto'  # xla|blockwise|pallas|pallas_tpu|pallas_mgpu|splash|cudnn|auto (mllm/ops/attention.py)
  )
  attention.block_q = placeholder(int)  # blockwise / pallas tile sizes; None: the impl's default
  attention.block_k = placeholder(int)
  attention.sliding_window = placeholder(int)  # None: full causal; W: the W most recent keys
  # With a window: every N-th layer attends globally (Gemma 2: 2, Gemma 3: 6); None: none does
  attention.global_every = placeholder(int)
  attention.qk_norm = False  # RMSNorm on q and k per head (Qwen3)
  attention.qk_norm_over = 'head'  # head (Qwen3) | projection: all heads' q, k at once (OLMo 2)
  attention.softmax_scale = placeholder(float)  # None: 1 / sqrt(head_dim)
  attention.logit_softcap = placeholder(float)  # Gemma 2: cap · tanh(q·kᵀ·scale / cap); None: off
  # σ(x·W) on each head's output before the output projection (Qiu et al. 2025): headwise |
  # elementwise; None: off
  attention.output_gate = placeholder(str)
  # Each layer after the first attends with λ₁·V + λ₂·V_first (ResFormer), λ learned from 0.5
  attention.value_residual = False
  attention.sinks = False  # a learned sink logit per head in the softmax (gpt-oss)
  attention.dropout = 0.0
  attention.use_bias = False  # biases on the q, k, v and output projections (GPT-2)
  attention.qkv_bias = False  # biases on q, k and v only (Qwen2); use_bias includes them

  position = model.position = config_dict.ConfigDict()
  position.kind = 'rope'  # none | learned | sinusoidal | shaw | t5 | rope | alibi
  # Each scheme's own section, declared with it (its Settings in mllm/layers/positions.py, RoPE's
  # scalings in rope.py): rope {theta, layout, original_max_len, scaling {kind: none | linear (PI)
  # | ntk | yarn | llama3, linear {factor}, ntk {factor}, yarn {factor, beta_fast, beta_slow},
  # llama3 {factor, low_freq_factor, high_freq_factor}}}, t5 {num_buckets, max_distance},
  # shaw {max_distance}. Only the chosen scheme's section may leave its defaults.
  add_sections(position, POSITIONS)

  ffn = model.ffn = config_dict.ConfigDict()
  # relu | relu2 | gelu | gelu_tanh | swish | glu | bilinear | geglu | geglu_tanh | swiglu | reglu |
  # clamped_swiglu (gpt-oss; its section: alpha, limit) | moe
  ffn.kind = 'swiglu'
  ffn.d_ff = placeholder(int)  # None: 4 * d_model
  ffn.match_params = True  # gated FFNs: d_ff * 2/3, so parameters match the ungated FFN
  ffn.multiple_of = 8
  ffn.use_bias = False
  # Each FFN's own section (a variant's Settings, mllm/layers/ffn.py): clamped_swiglu's {alpha,
  # limit}; moe's (MoESettings, mllm/layers/moe_settings.py): num_experts, top_k, expert {kind,
  # and each dense FFN's section}, expert_d_ff, num_shared_experts, shared_d_ff, every,
  # first_dense_layers, router, router_bias, renormalize, routed_scale, groups, top_groups,
  # dispatch, capacity_factor, grouped_matmul, balance_coef, balance_convention, z_loss_coef, noise,
  # noise_alpha, expert_bias, bias_update_rate, force_uniform_routing.
  add_sections(ffn, FFNS)

  norm = model.norm = config_dict.ConfigDict()
  norm.kind = 'rmsnorm'  # layernorm | rmsnorm | partial_rmsnorm | none
  norm.placement = 'pre'  # pre | post | sandwich (Gemma 2, Peri-LN) | output (OLMo 2)
  norm.eps = 1e-6
  norm.fp32 = True  # statistics in float32 (the notebook's qwen3_compatible)
  norm.use_bias = placeholder(bool)  # None: layernorm True, rmsnorm False (its optional shift)
  norm.unit_offset = False  # the gain stored as w in γ = 1 + w, from 0 (Gemma, Qwen3-Next)
  norm.final_norm = True
  add_sections(norm, NORMS)  # each norm's own section (mllm/layers/norms.py): partial_rmsnorm {p}

  data = config.data = config_dict.ConfigDict()
  data.source = 'stdlib'  # stdlib (this Python's library) | kjv (King James Bible) | text | jsonl | parquet | hf
  data.path = placeholder(str)  # text/jsonl/parquet: a file or folder; hf: a dataset name or folder
  data.text_field = 'text'  # jsonl / parquet / hf: the column holding the text
  data.hf_config = placeholder(str)  # hf: the dataset's config name, if it has several
  data.hf_split = 'train'  # hf: the split to read (mllm makes its own train/val split)
  data.val_fraction = 0.02  # documents go to val by a hash of their path (or row id)
  data.tokenizer = 'bpe'  # bpe (HF tokenizers, trained on the train split) | byte (256 + specials)
  data.tokenizer_train_bytes = 8_000_000  # bpe: train on at most this much text
  # bpe: the special tokens that end a document and fill padding (an imported Hugging Face
  # tokenizer names its own: '</s>', '<|endoftext|>', ...)
  data.eos_token = '<eos>'
  data.pad_token = '<pad>'
  data.cache_dir = placeholder(str)  # None: $MLLM_CACHE_DIR or ~/.cache/mllm
  data.document_mask = True  # packed documents: per-document positions, no cross-document attention
  data.seq_len = 256
  data.batch_size = 8  # global batch, split over processes and the (data, fsdp, expert) mesh axes

  train = config.train = config_dict.ConfigDict()
  train.steps = 500
  # Peak, after warm-up, at d_model 256. 3e-3 with fan_in init is the best pair of a grid over both
  # at this config (experiments/results/defaults); at d_model 128 the best is 6e-3 (defaults_d128),
  # at 96 8e-3 (unseen_width): the best rate halves as the width doubles, so the standard
  # parametrization scales the peak by model.parametrization.standard.lr_base_d_model (256) /
  # d_model (None there: this rate as given); µP scales its hidden matrices' rates instead.
  train.learning_rate = 3e-3
  train.schedule = 'cosine'  # cosine | linear | constant | inverse_sqrt (each after linear warm-up)
  train.warmup_steps = 50
  train.min_lr_ratio = 0.1  # cosine / linear decay to learning_rate * this
  # adamw | muon (mllm/optimizers.py); each optimizer's own section: muon {beta, ns_steps,
  # nesterov, consistent_rms, adam_lr_ratio}. Muon's AdamW part (embeddings, head, norms, biases)
  # reads the Adam keys below, as adamw does.
  train.optimizer = config_dict.ConfigDict({'kind': 'adamw'})
  add_sections(train.optimizer, OPTIMIZERS)
  train.b1 = 0.9
  train.b2 = 0.95
  train.eps = 1e-8
  train.weight_decay = 0.1  # decoupled (AdamW's, and Muon's on its matrices)
  train.decay_embeddings = False  # weight decay on embedding tables (and a tied head)
  train.decay_norms_and_biases = False
  train.grad_clip = 1.0  # global-norm clipping; 0 turns it off
  # PaLM's output z-loss (Chowdhery et al. 2022, sec. 5: 1e-4): + coef · mean(log² Z) of the logits,
  # which keeps log Z near 0 (Wortsman et al. 2023: it removes the output-logit divergence)
  train.z_loss_coef = 0.0
  # The multi-token-prediction loss's weight (DeepSeek-V3: 0.3 for its first 10T of 14.8T tokens,
  # then 0.1): mtp_coef until mtp_switch_at of the steps, mtp_coef_final after
  train.mtp_coef = 0.3
  train.mtp_coef_final = 0.1
  train.mtp_switch_at = 0.68
  train.grad_accum_steps = 1  # micro-batches per step; data.batch_size is split between them
  train.log_every = 10
  train.eval_every = 100  # and at the end; 0: only at the end
  train.eval_batches = 16  # 0: the whole validation split
  train.checkpoint_every = 100  # and at the end and on SIGTERM / SIGINT
  train.max_to_keep = 3
  train.async_checkpoint = True
  train.peak_flops = placeholder(float)  # per device, for MFU; None: look the chip up
  # A fresh run starting from the parameters of another: "workdir:PATH" (its latest checkpoint, or
  # PATH/checkpoints/<step>), or "hf:PATH" (a Hugging Face checkpoint folder; launch.py then takes
  # the model config and tokenizer from it). Optimizer, step and data start anew; ignored once
  # this run has saved.
  train.init_from = placeholder(str)
  train.tensorboard = True

  # -1: all devices left; expert shards MoE experts (and splits the batch like data)
  config.mesh = config_dict.ConfigDict(dict(data=-1, fsdp=1, expert=1, tensor=1))
  return apply_choices(config, arg, after_set=reset_replaced)


# The choice sections of the schema, each with its registry (nested ones, such as RoPE's scaling,
# are reached through their variant's settings).
FAMILIES = {
  'model.position': POSITIONS,
  'model.ffn': FFNS,
  'model.attention': ATTENTIONS,
  'model.norm': NORMS,
  'model.parametrization': PARAMETRIZATIONS,
  'train.optimizer': OPTIMIZERS,
}


def reset_replaced(config: config_dict.ConfigDict, path: str) -> None:
  """Choosing a variant ('pos=alibi', 'rope_scaling=none', 'norm=layernorm', 'ffn=swiglu')
  resets the sections of those not chosen, so another variant's settings made earlier in the
  choices (a named config's own) do not follow into the ablation: configs/qwen3_like.py:pos=alibi
  drops Qwen3's RoPE θ."""
  if path.endswith('.kind') and (registry := _registry_of(path[: -len('.kind')])) is not None:
    reset_unread(get_path(config, path[: -len('.kind')]), registry)


def _registry_of(section: str):
  """The registry of the choice section at dotted path `section` ('model.position',
  'model.position.rope.scaling'), or None if it is none."""
  for family, registry in FAMILIES.items():
    if section == family:
      return registry
    if section.startswith(family + '.'):
      parts = section[len(family) + 1 :].split('.')
      for variant, field in zip(parts[::2], parts[1::2], strict=False):
        chooser = {k.name: k for k in keys_of(registry.get(variant))}.get(field)
        if chooser is None or chooser.choices is None:
          return None
        registry = chooser.choices
      return registry if len(parts) % 2 == 0 else None
  return None


def set_key(config: config_dict.ConfigDict, path: str, value) -> None:
  """config[path] = value, then the keys of a variant it replaced reset (`reset_replaced`): how a
  `--config.KEY=VALUE` flag, a suite's override and a Hugging Face import set a key, as a choice
  does."""
  set_path(config, path, value)
  reset_replaced(config, path)
