"""Diagnosis suites that train some rows of another suite 4x longer, evaluated during training
(loss_vs_tokens.png), each row at the learning rate the other suite tuned for it (lr_from)."""

from experiments.suite import Suite

# 4x the cpu preset's steps (4 M tokens), evaluated every 250 steps.
LONGER = {'cpu': {'train.steps': 2000, 'train.eval_every': 250}, 'tiny': {'train.eval_every': 2}}


def longer_copy(
  donor: Suite, *, name: str, description: str, keep: tuple[str, ...], **fields
) -> Suite:
  """The `keep` rows of `donor` (in its order) over LONGER's budget, at `donor`'s tuned rates;
  `fields`: any other Suite field (e.g. extra_metrics; diagnoses_of='' makes a scored table of
  its own rather than a diagnosis suite)."""
  presets = fields.pop('presets', donor.presets)
  return Suite(
    name=name,
    description=description,
    base=donor.base,
    variants=tuple(v for v in donor.variants if v.name in keep),
    presets={
      preset: {**overrides, **LONGER.get(preset, {})} for preset, overrides in presets.items()
    },
    lr_from=donor.name,
    paper_source=donor.paper_source,
    **{'diagnoses_of': donor.name, **fields},
  )
