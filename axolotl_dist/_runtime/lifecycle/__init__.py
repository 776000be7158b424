"""The lifecycle room: a process's kit services from first use to exit.

* :mod:`.teardown`: the services a group's first use starts, the exit hook,
  ``cleanup_distributed``.
* :mod:`.warnfold`: Python warnings raised alike on several ranks printed once, by rank 0
  (it rides on rank 0's heartbeat: ``liveness/heartbeat.Rider``).
"""
