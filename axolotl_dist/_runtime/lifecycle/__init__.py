"""The lifecycle room: a process's kit services from first use to exit.

* :mod:`.services`: the services a group's first use starts (exit hook, heartbeat).
* :mod:`.repeat_failure`: a start-up failure that repeats stops torchrun's restarts.
* :mod:`.startup`: the start-up report (``AXOLOTL_DIST_STARTUP``): where init's time went.
* :mod:`.teardown`: the exit hook and ``cleanup_distributed``.
* :mod:`.lifecycle_state`: this room's per-process state.
* :mod:`.warnfold`: Python warnings raised alike on several ranks printed once, by rank 0
  (it runs on rank 0's heartbeat: ``liveness/heartbeat.HeartbeatTask``).
"""
