"""Diagnosis of `stability`'s QK-norm rows: at each row's own best rate QK-norm trails the
baseline by 0.05 nats at 1 M tokens (1.2 tokens/param), where Wortsman et al. 2023 (arXiv
2309.14322, Fig. 1) find the best losses about equal at every size they train, for far more
tokens. In `stability`'s training curves the gap (train loss, per 50 steps) opens to ~0.06-0.07
by step 150 and narrows to ~0.04 by step 500 on all three seeds, so the first suspect is the token
budget: with q and k normalised per head, a score q·k/√d_head starts bounded by √d_head times the
norms' gains (4 here, heads of 16; the largest logit at the best rate is 11 against the
baseline's 30), and sharp attention waits for those gains to grow. The baseline and both QK-norm
rows train 4x longer (4 M tokens), evaluated every 250 steps, each at the rate `stability` tuned
for it; the diagnosis holds if the gap is still closing over the last half of these runs."""

from experiments.suites import stability
from experiments.suites._longer import longer_copy

SUITE = longer_copy(
  stability.SUITE,
  name='stability_tokens',
  description='the baseline vs QK-norm (and QK-norm + z-loss) over 4x the tokens, eval loss '
  'against tokens',
  keep=('baseline', 'qk_norm', 'qk_norm+z_loss'),
)
