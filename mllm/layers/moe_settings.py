"""`model.ffn.moe`: the keys the MoE FFN reads (`MoESettings`, each with its default, rule and doc),
which layers are MoE (`moe_layers`) and the rules across its keys (`check_moe_config`), run by
validation before anything is built."""

from __future__ import annotations

import dataclasses

from mllm.checks import ConfigError, integer, number, positive
from mllm.layers.ffn import DENSE_FFNS
from mllm.layers.moe_experts import DISPATCHES, GROUPED_MATMULS
from mllm.layers.moe_routing import BALANCE_CONVENTIONS, NOISES, ROUTERS
from mllm.variant_config import Chosen, choice, one_of_these, setting


def _coefficient(name, value) -> None:
  number(name, value, 0.0, 1e3, 'a loss coefficient (0: off)')


def _count(name, value) -> None:
  integer(name, value, 0)


@dataclasses.dataclass(frozen=True)
class MoESettings:
  """`model.ffn.moe`: the keys the MoE FFN (`model.ffn.kind='moe'`) reads. `ffn.d_ff`,
  match_params and multiple_of size the experts and the dense layers as they size a dense FFN,
  and `ffn.use_bias` gives both biases (gpt-oss's experts have them; Switch's, Mixtral's and
  DeepSeek's do not);
  `expert` chooses the experts' FFN with its own settings (`model.ffn.moe.expert.kind`)."""

  num_experts: int = setting(8, 'routed experts E', integer)
  top_k: int = setting(2, 'experts per token: 1 Switch; 2 GShard, Mixtral')
  expert: Chosen = choice(  # noqa: RUF009 (a field)
    DENSE_FFNS, 'swiglu', "the experts' FFN, and the dense layers' in a mixed stack"
  )
  expert_d_ff: int | None = setting(
    None, "None: the dense FFN's hidden size; smaller: fine-grained", integer
  )
  num_shared_experts: int = setting(
    0,
    'always-on experts beside the routed ones (DeepSeekMoE)',
    _count,
  )
  shared_d_ff: int | None = setting(None, 'None: expert_d_ff', integer)
  every: int = setting(
    1, 'layer i is MoE when (i + 1) % every == 0 and i >= first_dense_layers', integer
  )
  first_dense_layers: int = setting(0, 'the first layers stay dense', _count)
  router: str = setting(
    'softmax',
    'softmax | sigmoid (DeepSeek-V3; gates normalised over the top k)',
    one_of_these(ROUTERS, 'router'),
  )
  renormalize: bool = setting(True, 'gates renormalised over the chosen k (Mixtral)')
  router_bias: bool = setting(False, "a learned bias on the router's logits (gpt-oss)")
  routed_scale: float = setting(
    1.0, "the routed experts' gates × this (DeepSeek-V3's routed_scaling_factor, 2.5)", positive
  )
  groups: int = setting(
    1,
    'expert groups for group-limited routing (DeepSeek-V3: 8, one per node); 1: none',
    integer,
  )
  top_groups: int | None = setting(
    None,
    'the groups a token may route to, those with the largest sums of their two best scores '
    '(DeepSeek-V3: 4); None: every group',
    integer,
  )
  dispatch: str = setting(
    'auto',
    'capacity | dropless (ragged_dot) | auto: capacity on CPU, else dropless',
    one_of_these(('auto', *DISPATCHES), 'dispatch'),
  )
  capacity_factor: float = setting(
    1.25,
    'capacity = ceil(tokens / experts * top_k * capacity_factor)',
    positive,
  )
  grouped_matmul: str = setting(
    'ragged_dot',
    'dropless kernel: ragged_dot | megablox (Pallas gmm, TPU) | tiled',
    one_of_these(GROUPED_MATMULS, 'grouped matmul'),
  )
  balance_coef: float = setting(0.01, 'Switch load-balancing loss, α', _coefficient)
  balance_convention: str = setting(
    'switch',
    'switch: 1 at uniform routing for every k | hf: k',
    one_of_these(BALANCE_CONVENTIONS, 'balancing-loss convention'),
  )
  z_loss_coef: float = setting(0.001, 'router z-loss (ST-MoE)', _coefficient)
  noise: str = setting(
    'none',
    'none | mixture: (1 - α)·p + α·ε | noisy_topk (Shazeer 2017); training only',
    one_of_these(NOISES, 'router noise'),
  )
  noise_alpha: float = setting(
    0.1,
    'α of the mixture noise',
    lambda n, v: number(n, v, 0.0, 1.0, 'the weight of the noise in the mixture'),
  )
  expert_bias: bool = setting(
    False, 'DeepSeek-V3 aux-loss-free balancing: a selection bias, no gradient'
  )
  bias_update_rate: float = setting(
    0.001,
    'γ in b ← b + γ·sign(mean load − load), after each step',
    lambda n, v: number(n, v, 0.0, 1e3, 'the bias step γ'),
  )
  force_uniform_routing: bool = setting(
    False, 'balanced assignment whatever the router says (benchmarks)'
  )


def moe_layers(m) -> list[int]:
  """The indices of the MoE layers (Qwen2-MoE's decoder_sparse_step and DeepSeek's
  first_k_dense_replace): i >= first_dense_layers and (i + 1) % every == 0; none in a model whose
  FFN is not an MoE."""
  if m.ffn.kind != 'moe':
    return []
  moe = m.ffn.moe
  return [i for i in range(m.n_layers) if i >= moe.first_dense_layers and (i + 1) % moe.every == 0]


def check_moe_config(m, p: str = 'model') -> None:
  """The rules across `model.ffn.moe`'s keys (each key's own rule is declared with it, and
  checked with the FFN's choice section)."""
  moe, q = m.ffn.moe, f'{p}.ffn.moe'
  if not 1 <= moe.top_k <= moe.num_experts:
    raise ConfigError(
      f'{q}.top_k',
      moe.top_k,
      f'each token goes to top_k of {q}.num_experts='
      f'{moe.num_experts} experts; allowed: 1 <= top_k <= {moe.num_experts}',
    )
  if moe.num_experts % moe.groups or moe.num_experts // moe.groups < 2:
    raise ConfigError(
      f'{q}.groups',
      moe.groups,
      f'splits {q}.num_experts={moe.num_experts} into equal groups of at least 2 (a group '
      f'scores by its two best); allowed: a divisor of {moe.num_experts} up to '
      f'{moe.num_experts // 2}',
    )
  top_groups = moe.groups if moe.top_groups is None else moe.top_groups
  if not 1 <= top_groups <= moe.groups or top_groups * moe.num_experts // moe.groups < moe.top_k:
    raise ConfigError(
      f'{q}.top_groups',
      moe.top_groups,
      f'allowed: 1 to {q}.groups={moe.groups}, keeping at least {q}.top_k={moe.top_k} experts '
      f'({moe.num_experts // moe.groups} a group), or None',
    )
  if not moe_layers(m):
    raise ConfigError(
      f'{q}.first_dense_layers',
      moe.first_dense_layers,
      f'with {q}.every={moe.every} this leaves no MoE layer among the '
      f'{m.n_layers}; allowed: a smaller value, or a smaller {q}.every',
    )
  if m.scan_layers and len(moe_layers(m)) != m.n_layers:
    raise ConfigError(
      f'{p}.scan_layers',
      True,
      f'scanned layers must be alike, but {q}.every='
      f'{moe.every} and {q}.first_dense_layers={moe.first_dense_layers} mix MoE '
      'and dense layers; allowed: false, or every=1 and first_dense_layers=0',
    )
