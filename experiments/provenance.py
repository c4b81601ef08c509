"""Which code and machine produced a run: recorded in every run's result (and so in its suite's
ledger), compared before a finished run is reused, and stated in results.md.

A run's numbers depend on mllm's code (and the kernels'), on jax and its libraries, and on the
device. `code` is a digest of the Python sources that compute them, read as syntax trees without
docstrings, so editing a comment or a docstring keeps it and any change to what runs does not.
The git commit and a dirty flag say where to find that code; they are not compared (a commit that
touches only docs or experiments/ leaves the numbers alone). Nor is the host's CPU (`host`): on the
CPU backend its vector units choose XLA's kernels, so two CPUs sum in different orders and a run
drifts from its twin by float rounding (measured 2026-11-30, bf16 cpu preset, AVX-512 against
AVX2: 3e-5 in the train loss at step 10, 1e-3 by step 100), a perturbation like a new draw of
noise, not a different computation; it is recorded so a report can say where its runs ran.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ('mllm', 'pallas_kernels')  # the packages whose code computes a run's numbers
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax')
# What must agree for two runs to be the same computation (the rest says where to find it). The
# Python version counts: the built-in corpus is its standard library, so another Python trains
# and evaluates on other text (Python 3.11's stdlib: 1,727 training documents; 3.13's: 1,678).
COMPARED = ('code', 'python', *PACKAGES, 'device')
# The CPU features that decide which kernels XLA:CPU (and its matmul libraries) run: the vector
# width and the bf16 / int8 dot instructions (x86 /proc/cpuinfo `flags`, Arm `Features`).
CPU_FEATURES = (
  'avx2', 'fma', 'avx512f', 'avx512_vnni', 'avx512_bf16', 'amx_bf16', 'amx_int8',
  'asimd', 'asimddp', 'bf16', 'i8mm', 'sve', 'sve2', 'sme',
)  # fmt: skip


def _cpuinfo() -> dict[str, str]:
  """/proc/cpuinfo's first processor as {field: value} (Linux); {} elsewhere."""
  fields = {}
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if not line.strip():
          break
        name, _, value = line.partition(':')
        fields[name.strip()] = value.strip()
  except OSError:
    pass
  return fields


def cpu_model(info: dict[str, str] | None = None) -> str:
  """The CPU's model name from /proc/cpuinfo (Linux), else what `platform` knows."""
  info = _cpuinfo() if info is None else info
  return info.get('model name') or platform.processor() or platform.machine()


def cpu_features(info: dict[str, str] | None = None) -> list[str]:
  """Which of CPU_FEATURES the CPU has, in CPU_FEATURES' order."""
  info = _cpuinfo() if info is None else info
  have = set((info.get('flags') or info.get('Features') or '').split())
  return [f for f in CPU_FEATURES if f in have]


def host(info: dict[str, str] | None = None) -> str:
  """'AMD EPYC, 2 cores: avx2 fma': the CPU that ran a run, its cores and CPU_FEATURES."""
  info = _cpuinfo() if info is None else info
  listed = 'flags' in info or 'Features' in info
  features = ' '.join(cpu_features(info)) or (
    'none of ' + '/'.join(CPU_FEATURES[:3]) if listed else 'features not listed'
  )
  return f'{cpu_model(info)}, {os.cpu_count()} cores: {features}'


def _without_docstrings(tree: ast.AST) -> ast.AST:
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if (
      isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
      and body
      and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)
    ):
      node.body = body[1:] or [ast.Pass()]
  return tree


def code_digest(root: str = ROOT, sources: tuple[str, ...] = SOURCES) -> str:
  """12 hex digits over every .py file under `sources` (path and syntax tree, docstrings and
  comments left out)."""
  digest = hashlib.sha256()
  for package in sources:
    for folder, dirs, files in sorted(os.walk(os.path.join(root, package))):
      dirs.sort()
      for name in sorted(f for f in files if f.endswith('.py')):
        path = os.path.join(folder, name)
        with open(path, encoding='utf-8') as f:
          tree = _without_docstrings(ast.parse(f.read(), filename=path))
        digest.update(os.path.relpath(path, root).encode() + b'\0')
        digest.update(ast.dump(tree, include_attributes=False).encode() + b'\0')
  return digest.hexdigest()[:12]


def git(*args: str) -> str | None:
  """`git -C ROOT ARGS`'s output, stripped; None where git or the repository is missing."""
  try:
    out = subprocess.run(
      ['git', '-C', ROOT, *args], capture_output=True, text=True, timeout=10, check=True
    )
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


@functools.cache
def _static() -> dict:
  """What does not change while a process lives: the code, the packages, the commit."""
  commit = git('rev-parse', '--short=12', 'HEAD')
  dirty = git('status', '--porcelain', '--', *SOURCES)
  record = {
    'code': code_digest(),
    'commit': commit,
    'dirty': None if commit is None or dirty is None else bool(dirty),
    'python': platform.python_version(),
    'host': host(),
  }
  for package in PACKAGES:
    try:
      record[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      record[package] = None
  return record


def current() -> dict:
  """This process's provenance: the code digest, commit and dirty flag, package versions, the
  host's CPU (`host`), and the kind of the first device (e.g. 'cpu', 'NVIDIA H100 80GB HBM3')."""
  import jax

  device = jax.devices()[0]
  return {**_static(), 'device': device.device_kind, 'backend': device.platform}


def same_computation(a: dict | None, b: dict | None, keys: tuple[str, ...] = COMPARED) -> bool:
  """Whether two records describe the same code on the same Python, packages and device kind
  (`keys`).
  A run without a record (finished before records were kept) matches nothing."""
  if not a or not b or not a.get('code') or not b.get('code'):
    return False
  return all(a.get(k) == b.get(k) for k in keys)


def label(record: dict | None) -> str:
  """One phrase naming a record: 'code 1a2b3c4d5e6f (commit 0123abcd, dirty), Python 3.13.0,
  jax 0.12.0.1, flax 0.12.2, optax 0.2.6 on cpu'; a run without one says when its ledger line was
  committed."""
  if not record or not record.get('code'):
    committed = (record or {}).get('ledger_commit')
    return 'not recorded' + (f' (finished by commit {committed})' if committed else '')
  commit = record.get('commit')
  where = f" (commit {commit[:8]}{', dirty' if record.get('dirty') else ''})" if commit else ''
  names = (('Python', 'python'), ('jax', 'jax'), ('flax', 'flax'), ('optax', 'optax'))
  packages = ', '.join(f'{name} {record[k]}' for name, k in names if record.get(k))
  return f"code {record['code']}{where}, {packages} on {record.get('device')}"


def by_host(runs: list[dict]) -> dict[str, int]:
  """How many runs ran on each host (`host`), most first; runs recorded before hosts were:
  'not recorded'."""
  counts = {}
  for run in runs:
    name = (run.get('provenance') or {}).get('host') or 'not recorded'
    counts[name] = counts.get(name, 0) + 1
  return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def hosts_phrase(hosts: dict[str, int]) -> str:
  """`by_host`'s counts in words: '12 runs on AMD EPYC, 2 cores: avx2 fma; 1 run on a host not
  recorded'."""
  return '; '.join(
    f"{n} run{'' if n == 1 else 's'} on "
    + ('a host not recorded' if name == 'not recorded' else name)
    for name, n in hosts.items()
  )


def key(record: dict | None) -> tuple:
  """What groups runs of the same computation (records without provenance: by their commit)."""
  if not record or not record.get('code'):
    return ('not recorded', (record or {}).get('ledger_commit'))
  return tuple(record.get(k) for k in COMPARED)


def by_version(runs: list[dict]) -> dict[tuple, list[dict | None]]:
  """The runs' provenance records grouped by `key`: one group per computation."""
  groups = {}
  for run in runs:
    record = run.get('provenance')
    groups.setdefault(key(record), []).append(record)
  return groups
