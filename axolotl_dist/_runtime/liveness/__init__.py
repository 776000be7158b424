"""The liveness room: who is alive, who waits for whom, and where everyone is.

Floors, one way: :mod:`.peers` <- :mod:`.stalls` <- :mod:`.dead_peers` <- :mod:`.heartbeat`, and
:mod:`.peers` <- :mod:`.stalls` <- :mod:`.failures` <- :mod:`.waits` <- :mod:`.polls`.

* :mod:`.peers`: each rank's record, what waiters read about peers, a store host that is gone.
* :mod:`.stalls`: rank 0's stall detector (silent ranks, deadlocks); a waiter's check of
  the ranks it waits for.
* :mod:`.lost`: the account of the ranks a wait found gone, the root cause first; this rank's
  part of a deadlock a lost peer ended on.
* :mod:`.heartbeat`: each rank's heartbeat thread (and the tasks that run on rank 0's).
* :mod:`.dead_peers`: a rank whose peer died ends, wherever it waits.
* :mod:`.deadlock`: the wait-for graph of every rank's long kit wait.
* :mod:`.progress`: this rank's call counters on each group (the meeting points ranks share).
* :mod:`.failures`: failure and exit records, the store host's wait for its readers, naming a lost peer.
* :mod:`.waits`: every kit wait, one watching wait; a collective's wait, in slices.
* :mod:`.polls`: a wait on a store probe (blocks, debug checks, ``shared_map``).
* :mod:`.where_report`: where every rank is, on request; the report of all ranks.
* :mod:`.flight`: each rank's last collective per group in torch's flight recorder; who is
  behind or mismatched, from every rank's.
* :mod:`.stuck`: each rank's watch of its torch collectives; a stuck one reports the run's
  where-report on its own.
* :mod:`.stragglers`: when each rank issued its collectives, compared on rank 0: a rank that
  issues most of them last is named.
* :mod:`.scopes`: collectives the other ranks cannot join are errors at once.
* :mod:`.liveness_state`: this room's per-process state.
* :mod:`.runs`: this host's run directory (``axolotl-dist where`` without an address).
"""
