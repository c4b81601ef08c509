"""Start one job as N processes on this machine, as a cluster launcher would start it on N hosts.

    python -m mllm.multiprocess -n 2 [--devices=2] -- launch.py --config=configs/base.py ...

Each process gets JAX_COORDINATOR_ADDRESS (127.0.0.1 and a free port), JAX_NUM_PROCESSES and
JAX_PROCESS_ID, which launch.py passes to `jax.distributed.initialize`; with --devices, XLA
gives each process that many CPU devices (--xla_force_host_platform_device_count), so 2 processes
x 2 devices form the 4-device global mesh a 2-host job would. The processes' output is prefixed
with their id; SIGTERM or Ctrl-C is passed on to all of them (each saves and exits); if one dies,
the others are stopped. The exit code is the first failure's, else 0.

This is JAX's own multi-controller runtime on localhost (the tests use it); on a cluster, start
the same command on every host through its scheduler instead (docs/multi-host.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def process_env(
  process_id: int, num_processes: int, port: int, devices: int | None, base: dict | None = None
) -> dict:
  """The environment of process `process_id` of the job."""
  env = dict(os.environ if base is None else base)
  env.update(
    JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
    JAX_NUM_PROCESSES=str(num_processes),
    JAX_PROCESS_ID=str(process_id),
  )
  if devices:
    env['XLA_FLAGS'] = with_host_devices(env.get('XLA_FLAGS', ''), devices)
    env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def with_host_devices(xla_flags: str, devices: int) -> str:
  """`xla_flags` with the host's CPU device count set to `devices` (any earlier count dropped,
  every other flag kept: a child compiled with other flags rounds otherwise)."""
  flags = [
    f for f in xla_flags.split() if not f.startswith('--xla_force_host_platform_device_count')
  ]
  return ' '.join(flags + [f'--xla_force_host_platform_device_count={devices}'])


def _relay(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, ''):
    out.write(f'{prefix}{line}')
    out.flush()


def run(
  command: list[str],
  num_processes: int,
  devices: int | None = None,
  env: dict | None = None,
  poll_s: float = 0.2,
) -> int:
  """Run `command` (argv after the python executable) as `num_processes` processes; the exit
  code."""
  port = free_port()
  procs, relays = [], []
  for i in range(num_processes):
    proc = subprocess.Popen(
      [sys.executable, *command],
      env=process_env(i, num_processes, port, devices, env),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    relay = threading.Thread(target=_relay, args=(proc.stdout, f'[{i}] ', sys.stdout), daemon=True)
    relay.start()
    procs.append(proc)
    relays.append(relay)

  def forward(signum, frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)

  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    failed = None
    while any(p.poll() is None for p in procs):
      for p in procs:
        if failed is None and p.poll() not in (None, 0):
          failed = p.returncode
          for other in procs:  # a job is whole or nothing: stop the rest, do not leave them
            if other.poll() is None:  # waiting out the coordinator's heartbeat
              other.terminate()
      time.sleep(poll_s)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for relay in relays:
    relay.join(timeout=5)
  codes = [p.returncode for p in procs]
  return failed if failed is not None else next((c for c in codes if c), 0)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m mllm.multiprocess',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('-n', '--num_processes', type=int, required=True)
  parser.add_argument(
    '--devices',
    type=int,
    default=None,
    help='CPU devices per process (XLA host platform); default: what JAX finds',
  )
  parser.add_argument(
    'command',
    nargs=argparse.REMAINDER,
    help='after --: the script and its arguments, e.g. launch.py --config=...',
  )
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if args.num_processes < 1:
    parser.error(f'-n {args.num_processes}; allowed: a positive number of processes')
  if args.devices is not None and args.devices < 1:
    parser.error(f'--devices={args.devices}; allowed: a positive number of devices per process')
  if not command:
    parser.error('no command; allowed: -- launch.py --config=... (the script and its arguments)')
  return run(command, args.num_processes, args.devices)


if __name__ == '__main__':
  sys.exit(main())
