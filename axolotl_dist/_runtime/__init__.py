"""The kit's private machinery: what every public helper stands on.

Nothing here is public API. Public modules (``axolotl_dist.ordering``, ``values``, ...)
import from this package; modules here import each other and, of the public ones, only the
small vocabulary every floor speaks: :mod:`axolotl_dist.errors`, :mod:`axolotl_dist.env`
(the launcher's variables) and :mod:`axolotl_dist.ranks` (rank queries), which themselves
import no kit module above the runtime's leaves (``tests/test_structure.py`` enforces these
rules and the absence of cycles). The design behind each module is in docs/design.md.

Process-wide facts

* :mod:`.state`: what this process has learnt (failures, peers, heartbeat, helper caches,
  debug switches, open first-run blocks), in one object with one ``reset()``.
* :mod:`.groups`: the kit's object for a process group (:class:`~.groups.Group`: ranks, size,
  device, call counters, buffers), resolved once per call by ``group_of``, the one function
  that does; the failure of another rank this process learnt.
* :mod:`.envvars`: reading env vars (ints with bounds, seconds, switches).
* :mod:`.backends`: what a backend string says about devices; the accelerator usable here.
* :mod:`.pickling`: the kit's modules pickle by name (``datasets`` fingerprints of functions
  that mention the kit are the same in every process and install mode).
* :mod:`.procs`: processes (``/proc`` state, children, killing a tree, loopback, listeners).
* :mod:`.callsite`: the user's file and line behind a helper call.
* :mod:`.logs`: log lines with the time, the level and ``[rank r/n]``; the kit's own logger.
* :mod:`.tracebacks`: tracebacks without the kit's frames (reports, error files, uncaught).

Signalling through the c10d store, one floor on the other (store <- peers <- watch <- wait)

* :mod:`.constants`: timings, their env-var names, this host's name, the kit's logger.
* :mod:`.store`: which store, who hosts it, lost-store errors, the store worker thread.
* :mod:`.peers`: peer records, the heartbeat thread, judging the store's host gone.
* :mod:`.watch`: judging the ranks a wait depends on (exit records, pids, heartbeats).
* :mod:`.bells`: a long wait sleeps in one blocking ``store.wait`` instead of polling.
* :mod:`.deadlock`: waits that can never end: each long wait's description, the judge's
  wait-for graph over all of them, the message naming every rank's call.
* :mod:`.wait`: every kit wait, one watching wait (registered for reports, judging the
  awaited ranks, described for the deadlock judge, warning at intervals): store probes and
  collectives' slices.
* :mod:`.where`: where every rank is: a snapshot of a rank on request, the report of all.
* :mod:`.runs`: this host's run directory: where each run's store is, one file per run, so
  ``axolotl-dist where`` needs no address.
* :mod:`.records`: failure reports, exit records, the store host's linger, naming the peer
  behind a failed collective.

Protocols built on those

* :mod:`.calls`: the wrapper every helper wears: resolves the call's group, takes the
  single-process shortcut, refuses calls nobody can join, one thread per group, tracing, the
  debug check.
* :mod:`.args`: checks of the helpers' arguments, with messages that say what to pass; the
  one list of reduction names.
* :mod:`.exchange`: how the kit's collectives run: values encoded, headers exchanged, works
  waited for; a failure caused by a lost peer named (the one place that translates it).
* :mod:`.blocks`: ``zero_first`` / ``do_n_at_a_time`` rounds.
* :mod:`.guards`: collectives the other ranks cannot join (inside a first-run block,
  ``zero_only`` code) are errors at once.
* :mod:`.threads`: two threads in helpers on one group at once are an error, never crossed
  values.
* :mod:`.cleanup`: deleting finished blocks' keys in the background.
* :mod:`.filesystem`: whether the nodes share a filesystem, asked of it (a probe file).
* :mod:`.debug_check`: debug mode's per-call check.
* :mod:`.slurm`: SLURM node-list and tasks-per-node syntax (the launcher variables' reader,
  :mod:`axolotl_dist.env`, needs it).
* :mod:`.warnfold`: Python warnings raised alike on several ranks printed once, by rank 0,
  naming the ranks (under launchers that do not fold output): the hook, what is held before
  the heartbeat, rank 0's pending table, the warnings' store log.
* :mod:`.trace`: recording this rank's kit calls for the timeline (``AXOLOTL_DIST_TRACE``):
  every helper records, so the recorder lives here; merging the files is the tracing
  feature's own (:mod:`axolotl_dist.tracing`).

Process lifetime

* :mod:`.teardown`: the services a group's first use starts, the exit hook and
  ``cleanup_distributed``.

What serves one feature only lives beside it, in that feature's package: the launcher's
rank bootstrap, failure report and signal watcher in :mod:`axolotl_dist.launch`, the trace
merge in :mod:`axolotl_dist.tracing`, ``shared_map``'s parts in :mod:`axolotl_dist.hf_data`.
"""
