"""What a run opens before its first step (`open_run`): the processes, the workdir, the mesh and
the state's structure, the checkpointer, the data; and the state it starts from
(`starting_state`): its latest checkpoint, else a fresh one. mllm/train/loop.py steps it."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax

from mllm.paths import writable_dir
from mllm.train import peers
from mllm.train.checkpoint import Checkpointer, config_as_dict, write_config
from mllm.train.checkpoint_folder import note
from mllm.train.cluster import maybe_initialize_distributed
from mllm.train.init_from import adopt_tokenizer, init_params
from mllm.train.logs import route_library_output
from mllm.train.resume import check_resumable, mismatch_error
from mllm.train.sharding import make_mesh
from mllm.train.state import setup
from mllm.train.state_signature import StateMismatch


@dataclasses.dataclass
class Run:
  """What a run opens before its first step: the mesh, the state's structure and initializer,
  the checkpointer, the data and its iterator; `closing` closes them on every exit."""

  config: Any
  workdir: str
  mesh: jax.sharding.Mesh
  setup: Any  # mllm.train.state.TrainSetup
  init: Callable[[], dict]  # the fresh train state (jitted, sharded)
  ckpt: Checkpointer
  data: Any  # mllm.data.Data
  iterator: Any  # the training batches; saved with each checkpoint
  saved_config: dict  # the config as saved with each checkpoint
  closing: contextlib.ExitStack
  data_s: float = 0.0  # seconds to build the data (corpus, tokenizer, token files; cached: ~0)
  devices_s: float = 0.0  # seconds to the mesh: the backend's start (~0 on a CPU)


@contextlib.contextmanager
def open_run(config, workdir: str):
  """Open what a run needs, in order: the processes, the workdir, the mesh and the state's
  structure, the checkpointer, the tokenizer (a run from a Hugging Face folder adopts its
  own), the data, and the config written beside the checkpoints."""
  from mllm.data import build_data
  from mllm.data.sources import check_path

  maybe_initialize_distributed()
  writable_dir('--workdir', workdir)
  check_path(config.data)
  t0 = time.perf_counter()
  mesh = make_mesh(config.mesh)  # the first device query starts the backend (seconds on a GPU)
  devices_s = time.perf_counter() - t0
  train_setup, init = setup(config, mesh)
  # Closing the checkpoint manager and the metrics writer on every exit, errors included, keeps
  # their background threads from dying noisily at interpreter shutdown.
  with contextlib.ExitStack() as closing:
    os.makedirs(workdir, exist_ok=True)
    closing.callback(route_library_output(workdir))  # undone last: after the closes below
    peers.watch(workdir)
    ckpt = Checkpointer(
      workdir, max_to_keep=config.train.max_to_keep, async_save=config.train.async_checkpoint
    )
    closing.callback(ckpt.close)
    resumes = check_resumable(workdir, config, ckpt, train_setup.abstract_state) is not None
    if not resumes and config.train.init_from:
      adopt_tokenizer(config, workdir)
    t0 = time.perf_counter()
    data = build_data(
      config, workdir, process_index=jax.process_index(), process_count=jax.process_count()
    )
    data_s = time.perf_counter() - t0
    write_config(workdir, config)
    yield Run(
      config=config,
      workdir=workdir,
      mesh=mesh,
      setup=train_setup,
      init=init,
      ckpt=ckpt,
      data=data,
      iterator=data.train_iterator(),
      saved_config=config_as_dict(config),
      closing=closing,
      data_s=data_s,
      devices_s=devices_s,
    )


def starting_state(run: Run) -> tuple[int, dict, str]:
  """(start step, state, how long it took): the latest checkpoint, else a fresh state
  (train.init_from's parameters)."""
  config = run.config
  t0 = time.perf_counter()
  try:
    start, state = run.ckpt.restore_latest(run.setup.abstract_state, run.iterator)
  except StateMismatch as err:  # check_resumable ran first; this is the safety net
    raise mismatch_error(run.workdir, config, run.ckpt, err.step, err.diff) from None
  if start is not None:
    if config.train.init_from:
      note(f'note: resuming this run at step {start}; train.init_from applies only to its start')
  else:
    start, state = 0, run.init()
    if config.train.init_from:
      state['params'] = init_params(config, run.setup.abstract_state['params'])
  state = jax.block_until_ready(state)
  return start, state, f"{'restore' if start else 'init'} {time.perf_counter() - t0:.1f} s"
