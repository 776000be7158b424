"""The liveness room: who is alive, who waits for whom, and where everyone is.

Floors, one way: :mod:`.peers` <- :mod:`.judge` <- :mod:`.heartbeat`, and
:mod:`.peers` <- :mod:`.judge` <- :mod:`.failures` <- :mod:`.waits` <- :mod:`.polls`.

* :mod:`.peers`: each rank's record, what waiters read about peers, a store host that is gone.
* :mod:`.judge`: rank 0's judge of silence and deadlocks; a waiter's own look beside it.
* :mod:`.heartbeat`: each rank's heartbeat thread (and what rides on rank 0's).
* :mod:`.deadlock`: the wait-for graph of every rank's long kit wait.
* :mod:`.failures`: failure and exit records, the store host's linger, naming a lost peer.
* :mod:`.waits`: every kit wait, one watching wait; a collective's wait, in slices.
* :mod:`.polls`: a wait on a store probe (blocks, debug checks, ``shared_map``).
* :mod:`.whereabouts`: where every rank is, on request; the report of all ranks.
* :mod:`.runs`: this host's run directory (``axolotl-dist where`` without an address).
"""
