"""The structure of a saved train state, read without its arrays: path → (shape, dtype) of every
leaf, compared with what a config builds, so a config change is told apart from a damaged
checkpoint (StateMismatch) before anything is restored."""

from __future__ import annotations

import jax

# {('params', 'blocks', '0', 'attention', 'query', 'kernel', 'value'): ((16, 4, 4), 'float32'), ...}
Signature = dict[tuple[str, ...], tuple[tuple[int, ...], str]]


def _key_name(key) -> str:
  for attr in ('key', 'name', 'idx'):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def signature(tree) -> Signature:
  """Path → (shape, dtype) of every array leaf of a pytree of arrays, ShapeDtypeStructs or Orbax
  ArrayMetadata. Paths are plain strings, so NNX Variables, optax NamedTuples and the nested
  dicts Orbax stores them as compare equal."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if hasattr(leaf, 'shape') and hasattr(leaf, 'dtype'):
      out[tuple(_key_name(k) for k in path)] = (tuple(leaf.shape), str(leaf.dtype))
  return out


def only(sig: Signature, prefix: str) -> Signature:
  return {path: v for path, v in sig.items() if path[0] == prefix}


def compare(saved: Signature, expected: Signature) -> dict[str, list]:
  """{'only_saved': [path], 'only_expected': [path], 'different': [(path, saved, expected)]}; all
  empty when the two structures agree."""
  return {
    'only_saved': sorted(set(saved) - set(expected)),
    'only_expected': sorted(set(expected) - set(saved)),
    'different': [
      (p, saved[p], expected[p])
      for p in sorted(set(saved) & set(expected))
      if saved[p] != expected[p]
    ],
  }


def format_path(path: tuple[str, ...]) -> str:
  return '/'.join(path)


class StateMismatch(Exception):
  """A checkpoint holds a state of another structure than the config builds (a config change)."""

  def __init__(self, step: int, diff: dict[str, list]):
    self.step, self.diff = step, diff
    super().__init__(f'checkpoint step {step} has another state structure: {describe_diff(diff)}')


def describe_diff(diff: dict[str, list], limit: int = 3) -> str:
  parts = []
  for what, paths in (
    ('saved but not in this config', diff['only_saved']),
    ('in this config but not saved', diff['only_expected']),
  ):
    if paths:
      shown = ', '.join(format_path(p) for p in paths[:limit])
      parts.append(f'{len(paths)} entries {what} ({shown}{", ..." if len(paths) > limit else ""})')
  if diff['different']:
    shown = ', '.join(
      f'{format_path(p)} {s[0]}/{s[1]} saved vs {e[0]}/{e[1]} here'
      for p, s, e in diff['different'][:limit]
    )
    parts.append(
      f"{len(diff['different'])} entries of another shape or dtype ({shown}"
      f"{', ...' if len(diff['different']) > limit else ''})"
    )
  return '; '.join(parts)
