"""The files the experiment runner adds to a run's folder, beside mllm's own (mllm/paths.py
RunDir): named once here, a module without imports, so the worker process can read it before
JAX starts."""

JOB = 'job.pkl'  # what the worker runs: the resolved config, the measure, the parent run
WORKER_LOG = 'worker.log'  # the worker's stdout and stderr, every attempt appended
RESULT = 'result.json'  # written last: a run with one is finished
ERRORS_LOG = 'errors.log'  # the traceback of each failed attempt
