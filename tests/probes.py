"""The project's own test plumbing: what a test may ask the kit about a process, and the one
door to make a process forget what the kit has learnt.

They live in the testing feature's private module ``axolotl_dist.testing._probes`` (the kit's
own harness resets every forked rank with :func:`reset_process_state`), not in the public
``axolotl_dist.testing``: a user's tests have no use for them. This file is the one place the
project's tests and benchmarks take them from (tests/test_structure.py checks it).
"""

from axolotl_dist.testing._probes import (
    StoreCalls,
    count_store_calls,
    failure_report,
    kill_tree,
    known_peers,
    known_failure,
    process_state,
    read_failure_report,
    reset_process_state,
    store_of,
)

__all__ = ["reset_process_state", "store_of", "kill_tree", "process_state", "known_peers",
           "known_failure", "count_store_calls", "StoreCalls", "failure_report", "read_failure_report"]
