"""The fault layer: every fault a run survives, below the engine, which calls its hooks.

- ``process.py``: the rank's process (process group on a free port, generators, host memory);
- ``watchdog.py`` and ``guardian.py`` (with ``store.py``, their shared store): no silent hang, a stopped rank
  ended from outside;
- ``preemption.py``: a stop signal saves at the step boundary (exit code 75);
- ``bad_steps.py``: non-finite steps stop the run and never overwrite the last good checkpoint;
- ``stragglers.py`` and ``data_wait.py``: a slow rank named, the loader that holds the steps back;
- ``supervisor.py`` and ``run_lock.py``: the command a scheduler runs, which returns after the ranks' save
  with their exit code (75: preempted), and one run per output folder;
- ``restarts.py``: what the supervisor restarts by itself (``MAX_RESTARTS``), and on which hosts.

Nothing here imports the engine, the models or the losses.
"""
