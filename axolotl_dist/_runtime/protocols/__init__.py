"""The protocols room: how the helpers meet across ranks.

* :mod:`.helpers`: the wrapper every communicating helper wears.
* :mod:`.exchange`: the value helpers' engine: headers exchanged, collectives run and waited
  for.
* :mod:`.headers`: each group's header buffers, through which the value helpers exchange.
* :mod:`.encoding`: how a value crosses: a header and a payload, a device tensor's bytes on
  its device.
* :mod:`.packets`: the tensor operations' structures in one all-gather (with their data, or
  their dtypes and shapes alone) and the shape check that makes a mismatch an error on every
  rank.
* :mod:`.codes`: which helper sent a value header (registered where each is decorated).
* :mod:`.blocks`: blocks through the store: bit words, pairing, failures.
* :mod:`.rounds`: ``do_n_at_a_time``'s rounds, a kind of block.
* :mod:`.zero_first`: a ``zero_first`` block on each side, and the arrivals confirmed later.
* :mod:`.checkpointing`: a ``checkpoint_dir`` call's two blocks (written, committed) and its
  files: staging, commit, rotation.
* :mod:`.leases`: who holds a checkpoint root: each rank's lease, known alive or dead where its
  process can be seen, so that what runs that ended left is removed and a second live run is told.
* :mod:`.map_cache`: a ``datasets`` map in a ``zero_first`` block that leaves the other ranks
  no cache file, said once.
* :mod:`.protocols_state`: this room's per-process state.
* :mod:`.threads`: one thread per group at a time.
* :mod:`.shared_fs`: whether the nodes share a filesystem, asked of it.
* :mod:`.debug_checks`: debug mode's per-call check that every rank is in the same call.
* :mod:`.raw_checks`: debug mode's check put on torch's own collectives while it is on.
* :mod:`.unchecked`: a waiting check's look at ranks inside a torch collective no check saw.
* :mod:`.timeline`: recording this rank's kit calls for the timeline (every helper records).
"""
