"""Diagnosis of the `moe` suite's top-1 row (worse than dense at equal active parameters, against
Switch Transformer, Fedus et al. 2022, Fig. 1, where top-1 pulls ahead early in training): dense,
top-1 and top-2 trained 4x longer (4 M tokens; each of 8 experts then sees ~500 k tokens, not
~125 k), evaluated every 250 steps, so loss_vs_tokens.png shows whether and where the curves
cross. Each variant's rate is tuned again at 4 M tokens (retune_lr), centred on the rate the `moe`
suite tuned for it at 1 M tokens (lr_from): the `*_tokens` suites' rows at 1 M-token rates were
the first suspect wherever a gap moved with the budget (attention_heads_tokens' MHA moved 6e-3 ->
4.24e-3)."""

from experiments.suites import moe
from experiments.suites._longer import longer_copy

SUITE = longer_copy(
  moe.SUITE,
  name='moe_tokens',
  description='dense vs MoE top-1 / top-2 (8 experts) over 4x the tokens, eval loss against tokens',
  keep=('dense', 'top1', 'top2'),
  extra_metrics=moe.SUITE.extra_metrics,
  retune_lr=('dense', 'top1', 'top2'),
)
