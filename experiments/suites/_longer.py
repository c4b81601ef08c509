"""Diagnosis suites that train some rows of another suite 4x longer, evaluated during training
(loss_vs_tokens.png), each row at the learning rate the other suite tuned for it (lr_from)."""

from experiments.suite import Suite

# 4x the cpu preset's steps (4 M tokens), evaluated every 250 steps.
LONGER = {'cpu': {'train.steps': 2000, 'train.eval_every': 250}, 'tiny': {'train.eval_every': 2}}


def longer_copy(
  donor: Suite,
  *,
  name: str,
  description: str,
  keep: tuple[str, ...],
  overrides: dict | None = None,
  **fields,
) -> Suite:
  """The `keep` rows of `donor` (in its order) over LONGER's budget, at `donor`'s tuned rates;
  `overrides`: dotted overrides added to every preset (e.g. another init); `fields`: any other
  Suite field (e.g. extra_metrics; diagnoses_of='' makes a scored table of its own rather than a
  diagnosis suite)."""
  return Suite(
    name=name,
    description=description,
    base=donor.base,
    variants=tuple(v for v in donor.variants if v.name in keep),
    presets={
      preset: {**own, **LONGER.get(preset, {}), **(overrides or {})}
      for preset, own in donor.presets.items()
    },
    lr_from=donor.name,
    paper_source=donor.paper_source,
    **{'diagnoses_of': donor.name, **fields},
  )


# Every evaluation of a headline table reads the whole validation split, not its first batches.
WHOLE_SPLIT = {'train.eval_batches': 0}
# Headline tables compute in bfloat16 (float32 parameters, optimizer state and loss): 1.33x a
# cpu-preset step on an AVX512-BF16 CPU (0.92x on an AVX2-only one: benchmarks/results/
# train_step-cpu.md, log 12), and `ffn_bf16` showed the `ffn` table's verdicts and
# every row's Δ unchanged by it (experiments/results/ffn_bf16/precision.md).
BF16 = {'model.dtype': 'bfloat16'}


def headline_copy(
  donor: Suite,
  *,
  name: str,
  description: str,
  seeds: int,
  overrides: dict | None = None,
  **fields,
) -> Suite:
  """Every row of `donor` over LONGER's budget as a scored table of its own: each rate tuned
  again at this budget (BUDGET_GRID around `donor`'s) on 2 tuning seeds, `seeds` paired seeds,
  every evaluation over the whole validation split, bfloat16 compute (BF16); `overrides`: more
  dotted overrides for every preset (another corpus); `fields`: any other Suite field."""
  every = tuple(v.name for v in donor.variants)
  return longer_copy(
    donor,
    name=name,
    description=description,
    keep=every,
    overrides={**WHOLE_SPLIT, **BF16, **(overrides or {})},
    retune_lr=every,
    diagnoses_of='',
    seeds=seeds,
    tune_seeds=2,
    **fields,
  )
