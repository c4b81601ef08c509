"""Mixture of experts (Shazeer et al. 2017; Switch, Fedus et al. 2022; DeepSeek-V3's aux-loss-free
bias): dense vs top-1 / top-2, the balancing loss on and off, router noise, with the load metrics
(coefficient of variation, max/mean, drop rate, dead experts)."""

from experiments.suite import Suite, Variant
from experiments.suites._presets import PRESETS

_MOE = {'model.ffn.moe.num_experts': 8, 'model.ffn.moe.expert.kind': 'swiglu'}


def _moe(name, expect='', **extra):
  overrides = {
    **_MOE,
    'model.ffn.moe.top_k': 2,
    **{f'model.ffn.moe.{k}': v for k, v in extra.items()},
  }
  return Variant(name, 'ffn=moe', overrides, expect=expect)


SUITE = Suite(
  name='moe',
  description='dense vs MoE (8 experts): top-k, balancing loss, router noise, aux-loss-free bias',
  base='configs/rope_swiglu.py',
  # Against dense: Switch (Fedus et al. 2022, Fig. 1 and Table 1) has top-1 ahead at equal
  # active FLOPs; top-2 activates 1.7x dense's parameters (Shazeer et al. 2017).
  # top1 gates its expert by the router probability p_i, as Switch does (eq. 2). Renormalised over
  # k = 1 the gate is 1 and the router gets no gradient from the loss: top1-renormalized keeps
  # that setting, the suite's top-1 row until 2026-11-26, as the diagnosis of its deficit.
  variants=(
    Variant('dense'),
    _moe('top1', 'better', top_k=1, renormalize=False),
    _moe('top1-renormalized', top_k=1),
    _moe('top2', 'better'),
    _moe('top2-no_balance', balance_coef=0.0),
    _moe('top2-noise_mixture', noise='mixture'),
    _moe('top2-noisy_topk', noise='noisy_topk'),
    _moe('top2-aux_free_bias', balance_coef=0.0, expert_bias=True),
  ),
  presets=PRESETS,
  extra_metrics='moe_load',
  paper_source='Switch Transformer (balancing loss alpha = 1e-2); qualitative: without balancing '
  'the load collapses onto few experts',
)
