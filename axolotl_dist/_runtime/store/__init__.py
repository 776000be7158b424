"""The store room: the c10d store the ranks signal through.

* :mod:`.keys`: every key the kit keeps in the store (nothing else spells one).
* :mod:`.records`: every record the kit keeps there, encoded and decoded (nothing else does).
* :mod:`.seals`: the run's secret at work: records sealed (HMAC) and ``where`` answers
  encrypted.
* :mod:`.access`: which store, who hosts it, what a lost store looks like, a worker thread.
* :mod:`.clients`: connecting to a run's store from outside its groups (``where``, the
  launcher), and the store's root under a group's prefix.
* :mod:`.wakeup`: a long wait blocks in one ``store.wait`` until woken instead of polling.
* :mod:`.store_state`: this room's per-process state.
* :mod:`.sweep`: deleting finished blocks' keys in the background.
* :mod:`.attempts`: each attempt of a restarted run in its own namespace of a store that
  outlives attempts.
"""
