"""glibc malloc settings that keep XLA:CPU's per-step buffers mapped from one step to the next.

XLA:CPU allocates each execution's temporary buffer (one block for all of a program's
intermediates: ~175 MB for a training step of the suites' cpu preset) from its worker threads.
glibc gives each such thread an arena of its own, and an arena serves a request above 64 MiB (or
above the mmap threshold, at most 32 MiB) with a fresh mmap that free() unmaps again: every step
then faults its whole buffer back in, a page at a time, and the kernel zeroes each page. On a
2-core EPYC that was a quarter of the step's CPU time (44,700 page faults a step;
benchmarks/results/train_step-cpu.md, log 14).

`keep_freed_memory()` puts every thread on the main arena (M_ARENA_MAX 1), serves large requests
from its heap rather than from mmap (M_MMAP_MAX 0) and keeps up to 2 GiB of freed memory in the
process (M_TRIM_THRESHOLD): after a few steps every buffer lands on pages already mapped. The price
is resident memory: the heap keeps its high-water mark (a few copies of the step's buffer).

A thread's arena is fixed by its first allocation, so this must run before JAX's CPU backend
starts its threads (the first computation; `import jax` alone is early enough): the entry points
call it first (launch.py, `python -m experiments` and its workers, the step benchmarks). A user's
own malloc settings win: where a MALLOC_* variable or a glibc.malloc tunable is set, nothing
changes (`MALLOC_ARENA_MAX=8` keeps glibc's defaults).
"""

from __future__ import annotations

import ctypes
import os
import platform

# mallopt(3)'s parameters (glibc's malloc.h) and the values set; mallopt takes a C int.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = {M_ARENA_MAX: 1, M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 2**31 - 1}


def users_own(environ) -> str | None:
  """The user's own malloc setting in `environ` (its name), if any."""
  for name in environ:
    if name.startswith('MALLOC_'):
      return name
  if 'glibc.malloc.' in environ.get('GLIBC_TUNABLES', ''):
    return 'GLIBC_TUNABLES'
  return None


def keep_freed_memory(environ=os.environ) -> bool:
  """Apply SETTINGS to this process's glibc malloc; True where applied (Linux with glibc, and
  no malloc setting of the user's own in `environ`)."""
  if platform.libc_ver()[0] != 'glibc' or users_own(environ):
    return False
  mallopt = ctypes.CDLL(None).mallopt
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  return all([mallopt(param, value) == 1 for param, value in SETTINGS.items()])
