"""The kit's private machinery, in five rooms. Nothing here is public API.

Each room imports itself and the rooms before it, never one after it
(``tests/test_structure.py`` checks it); its own docstring maps its modules:

1. :mod:`.base`: process state, groups, backends, settings, call sites, text, logs.
2. :mod:`.store.access`: the c10d store the ranks signal through.
3. :mod:`.liveness`: who is alive, who waits for whom, where everyone is.
4. :mod:`.protocols`: how the helpers meet across ranks (the wrapper, the value engine, the
   blocks, debug mode's check).
5. :mod:`.lifecycle`: a process's kit services from first use to exit.

Public modules import from the rooms; of the public ones, the rooms import only the
vocabulary every floor speaks (:mod:`axolotl_dist.errors`, :mod:`axolotl_dist.env`,
:mod:`axolotl_dist.ranks`). docs/design/rooms.md, "The runtime's rooms", says which room a change
goes to.
"""
