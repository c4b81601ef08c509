"""`stability`'s z-loss rows without weight decay: the experiment that says whether mllm's default
decay is why the z-loss changes nothing there. Wortsman et al. 2023 (arXiv 2309.14322) train with
an independent weight decay of 1e-4 a step (Sec. 2.1); mllm's default is AdamW's coupled decay
0.1, i.e. lr · 0.1 a step: 1e-2 at lr 1e-1, 100x theirs, which by itself shrinks the output
head's weights and so bounds log Z. In `stability`'s tuning sweep (seed 1000) the z-loss curve lay
on the baseline's at every rate (log Z 7.3-8.5, never drifting negative). Here both rows train with
no decay over the same two decades of rate: if the output logits now diverge at high rates, the
baseline's LR sensitivity rises and the z-loss lowers it (Fig. 4), and the decay explains
`stability`'s z-loss row; if not, that row's result stays unexplained by it."""

import dataclasses

from experiments.suites import stability

NO_DECAY = {'train.weight_decay': 0.0}

# `stability`'s sweep, grid, presets and z-loss claim as they are; only the decay and the rows
# differ (derived, so that the two suites cannot drift apart).
SUITE = dataclasses.replace(
  stability.SUITE,
  name='stability_no_decay',
  description='final loss and output log Z against two decades of learning rate without weight '
  'decay, with and without the z-loss',
  variants=tuple(
    dataclasses.replace(v, overrides={**v.overrides, **NO_DECAY})
    for v in stability.SUITE.variants
    if v.name in ('baseline', 'z_loss')
  ),
  stability_claims={'z_loss': stability.SUITE.stability_claims['z_loss']},
  diagnoses={},  # stability's are of its QK-norm rows, not run here
  paper_source='Wortsman et al. 2023 (arXiv 2309.14322), Fig. 4: z-loss 1e-4 removes '
  'output-logit divergence and lowers the LR sensitivity (their decay: independent, 1e-4); the '
  'best loss is about unchanged',
)
