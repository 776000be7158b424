"""The base room: what every other room stands on; it imports no other room.

* :mod:`.state`: the registry of every room's per-process state, one ``reset()``; the base room's own;
  ``PerGroup``, the map a room keeps its per-group state in.
* :mod:`.groups`: the kit's object for a process group (``Group``: which group, nothing a room
  keeps about it), resolved by ``group_of``.
* :mod:`.hooks`: every place a lower room runs code of a higher one, typed, in one module.
* :mod:`.backends`: what a backend string says about devices; the accelerator usable here.
* :mod:`.constants`: timings, this host's name (the kit's env vars and how they are read are
  the vocabulary's: :mod:`axolotl_dist.env.variables`).
* :mod:`.callsite`: the user's file and line behind a helper call.
* :mod:`.text`: words messages share (``ranks 0-3``); a line's rank tag, written and read.
* :mod:`.kitlog`: log lines with time, level and ``[rank r/n]``.
* :mod:`.tracebacks`: tracebacks without the kit's frames.
* :mod:`.torch_messages`: the one reader of torch's error messages (a peer lost, the store
  gone, a wait timed out, the store's port taken), each checked against the installed torch.
* :mod:`.procs`: processes (``/proc``, children, killing a tree, loopback, listeners).
* :mod:`.private`: the kit's own directories, files and sockets on a host, its user's alone.
* :mod:`.mapped_file`: a file appended to through a shared memory map (the timeline's).
* :mod:`.pickling`: the kit's modules pickle by name.
* :mod:`.args`: checks of the helpers' arguments, with messages that say what to pass.
"""
