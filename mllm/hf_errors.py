"""The Hugging Face interop's one-line errors, low enough that a variant's own HF mapping
(mllm/layers/) raises them without importing mllm.interop (which re-exports them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class HFImportError(ValueError):
  """A checkpoint mllm cannot represent exactly, or a malformed one (one line)."""


class HFExportError(ValueError):
  """An mllm model no transformers class represents exactly (one line)."""


def refuse(hf: dict, field: str, allowed: Callable[[Any], bool], what: str) -> None:
  """HFImportError if config.json sets `field` to a value `allowed` rejects (absent is fine)."""
  if field in hf and not allowed(hf[field]):
    raise HFImportError(f'{field}={hf[field]!r}: mllm has no equivalent; allowed: {what}')
