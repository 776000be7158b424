"""The kit's private machinery: what every public helper stands on.

Nothing here is public API. Public modules (``axolotl_dist.ordering``, ``values``, ...)
import from this package; modules here import each other and, of the public ones, only
:mod:`axolotl_dist.errors` (``tests/test_structure.py`` enforces both rules and the absence
of cycles). The design behind each module is in docs/design.md.

Process-wide facts

* :mod:`.state`: what this process has learnt (failures, peers, heartbeat, helper caches,
  debug switches, open first-run blocks), in one object with one ``reset()``.
* :mod:`.groups`: what the kit remembers per process group; the default group.
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
* :mod:`.wait`: bounded polling waits that warn and name who they wait for.
* :mod:`.where`: where every rank is: a snapshot of a rank on request, the report of all.
* :mod:`.works`: waiting for a collective's work in slices: interruptible, watching peers;
  keeping a group whose collective Ctrl-C left pending alive at exit.
* :mod:`.records`: failure reports, exit records, the store host's linger, naming the peer
  behind a failed collective.

Protocols built on those

* :mod:`.blocks`: ``zero_first`` / ``do_n_at_a_time`` rounds.
* :mod:`.guards`: collectives the other ranks cannot join (inside a first-run block,
  ``zero_only`` code) are errors at once.
* :mod:`.threads`: two threads in helpers on one group at once are an error, never crossed
  values.
* :mod:`.cleanup`: deleting finished blocks' keys in the background.
* :mod:`.debug_check`: debug mode's per-call check.
* :mod:`.codec`: how the value helpers encode values.
* :mod:`.headers`: the value helpers' header exchange, per-group buffers, helper mismatches.
* :mod:`.reduce`: reduction names. :mod:`.shards`: rows per rank.
* :mod:`.hf_parts`: ``shared_map``'s parts, files and fingerprints (needs ``datasets``).
* :mod:`.slurm`: SLURM node-list and tasks-per-node syntax.
* :mod:`.trace`: recording this rank's kit calls for the timeline (``AXOLOTL_DIST_TRACE``);
  :mod:`.trace_merge`: merging every rank's file into one Chrome trace, a summary, a picture.

Process lifetime

* :mod:`.teardown`: the exit hook and ``cleanup_distributed``.
* :mod:`.rank_main`: the bootstrap each rank runs under ``axolotl-dist``.
* :mod:`.launch_report`: the launcher's account of a failed run.
* :mod:`.launch_watch`: the launcher's watcher of signals (Ctrl-C in the rendezvous, SIGUSR1).
"""
