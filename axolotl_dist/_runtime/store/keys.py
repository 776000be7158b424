"""Every key the kit reads or writes in the c10d store, and nothing else (docs/design/store.md,
"Store keys", lists them; ``tests/test_structure.py`` checks that no other module spells one
and that the table matches :data:`DOCUMENTED`).

Two namespaces:

* **group keys**, under the group's store prefix: everything starts with ``axd/``;
* **root keys**, at the root of the store under no group's prefix, ``axolotl_dist/...``: what a
  client of the store must find with only ``MASTER_ADDR:MASTER_PORT`` (``axolotl-dist where``).

A protocol that keeps several keys per call (a block, a debug check, a ``shared_map`` call)
gets its base here and appends its own parts to it.
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = [
    "RUN", "EXITS", "EXIT_LOG", "STALL_REPORT", "WAITERS", "WARN_LOG", "waiting", "exit_record",
    "exit_pending", "ack", "gone", "deadlock", "block", "debug_check",
    "shared_fs", "shared_map", "clock", "RUN_NOTE", "who", "heartbeat", "where_answer",
    "long_wait", "stuck", "stuck_report", "arrivals", "straggler",
    "where_question", "rendezvous_prefix",
    "rendezvous_port", "rendezvous_addr",
    "is_rendezvous_port", "rendezvous_round", "ATTEMPTS", "attempt_join", "attempt_answer",
    "attempt_joined", "attempt_prefix", "DOCUMENTED", "is_counter", "as_named", "REQUEST",
    "NOTICE", "BEATS", "requests_of", "notices_of", "dead", "EVENTS", "STALL_ROUND", "LONG_WAITS",
    "WARNED", "UNREAD",
]

# --- group keys --------------------------------------------------------------------------------

#: The run id the ranks agree on (``compare_set`` at init: the first proposal wins).
RUN = "axd/run"
#: A counter: low 32 bits count events (exit records, changes in the stall detector's report:
#: :data:`EVENTS`), the bits above count the stall detector's rounds (:data:`STALL_ROUND` each).
EXITS = "axd/exits"
#: The events part of :data:`EXITS`.
EVENTS = (1 << 32) - 1
#: What the stall detector adds to :data:`EXITS` each round (+1 if its report changed).
STALL_ROUND = 1 << 32
#: The ranks that left an exit record, in order (``"3,0,"``).
EXIT_LOG = "axd/exit_log"
#: The stall detector's report (JSON): silent ranks and waits that can never end.
STALL_REPORT = "axd/stalls"
#: A counter: low 32 bits the kit waits that run long now (:data:`LONG_WAITS`), bits 32-61 the
#: Python warnings ranks published (:data:`WARNED` each), bit 62 rank 0 reads no more of them
#: (:data:`UNREAD`).
WAITERS = "axd/waiters"
#: The long waits' part of :data:`WAITERS`.
LONG_WAITS = (1 << 32) - 1
#: What a rank adds to :data:`WAITERS` per warning it appended to :data:`WARN_LOG`.
WARNED = 1 << 32
#: What rank 0 adds to :data:`WAITERS` at its exit: it reads no more warnings.
UNREAD = 1 << 62
#: The Python warnings ranks above 0 published (``append``), for rank 0 to fold.
WARN_LOG = "axd/warn_log"


def waiting(rank: int) -> str:
    """How many of global ``rank``'s kit waits run long now."""
    return f"axd/waiting/{rank}"


def exit_record(rank: int) -> str:
    """Global ``rank``'s exit record."""
    return f"axd/exit/{rank}"


def exit_pending(rank: int) -> str:
    """Set when global ``rank`` exits with a collective left pending."""
    return f"axd/exit/{rank}/pending"


def gone(rank: int) -> str:
    """Global ``rank`` will not touch the store again (its last store call)."""
    return f"axd/gone/{rank}"


def deadlock(digest: str) -> str:
    """A deadlock's finding, by the digest of what every rank involved waits in."""
    return f"axd/deadlock/{digest}"


def ack(record: str, reader: int) -> str:
    """Global rank ``reader`` read the record at key ``record`` (a failure report, an exit
    record, a deadlock's finding): the publisher, if it hosts the store, waits for these."""
    return f"{record}/ack/{reader}"


#: ``block(kind, seq)``: the base of block ``seq`` of ``kind`` (``zf``: ``zero_first``, ``dn``:
#: ``do_n_at_a_time``, ``ck``: ``checkpoint_dir``); the block appends its words, ``site``,
#: ``mismatch``, ``wake``, ``done``. A bound ``str.format``, not a function: a block is made on
#: a loop's hot path, and this costs it no Python frame.
block: Callable[[str, object], str] = "axd/{}/{}".format


def debug_check(seq: int) -> str:
    """The base of debug mode's check of call ``seq``: ``c/<rank>``, ``d/<digest>``, ``n``,
    ``abort`` below it."""
    return f"axd/dbg/{seq}"


def shared_fs(digest: str) -> str:
    """The shared-filesystem probe of a directory (``/seen`` below it: the arrivals)."""
    return f"axd/fs/{digest}"


def shared_map(seq: int) -> str:
    """The base of ``shared_map`` call ``seq``."""
    return f"axd/sm/{seq}"


def clock(rank: int, round_: int, side: str) -> str:
    """Round ``round_`` of global ``rank``'s clock alignment with rank 0: ``ping`` (the rank's),
    ``pong`` (rank 0's clock)."""
    return f"axd/clk/{rank}/{round_}/{side}"


# --- root keys ---------------------------------------------------------------------------------

#: ``{"run": id, "world": size}``: what a client of the store asks first.
RUN_NOTE = "axolotl_dist/run"


def who(run: str, rank: int) -> str:
    """Global ``rank``'s record in run ``run``: host, pid, machine, launcher."""
    return f"axolotl_dist/{run}/who/{rank}"


def heartbeat(run: str, rank: int) -> str:
    """Global ``rank``'s heartbeat counter: the low 32 bits count its beats, bits 32-47
    ``where``'s requests for its snapshot (:data:`REQUEST`), the bits above the deaths
    announced to it (:data:`NOTICE`)."""
    return f"axolotl_dist/{run}/hb/{rank}"


#: What a ``where`` requester adds to a heartbeat counter, and what an announced death adds.
REQUEST, NOTICE = 1 << 32, 1 << 48
#: The beats part of a heartbeat counter.
BEATS = REQUEST - 1


def requests_of(count: int) -> int:
    """The ``where`` requests a heartbeat counter holds."""
    return (count & (NOTICE - 1)) >> 32


def notices_of(count: int) -> int:
    """The deaths announced to the rank of a heartbeat counter."""
    return count >> 48


def dead(run: str) -> str:
    """The first death announced in the run (a failure report: :mod:`..liveness.dead_peers`)."""
    return f"axolotl_dist/{run}/dead"


def where_answer(run: str, rank: int) -> str:
    """Global ``rank``'s snapshot of where it is, when asked (JSON)."""
    return f"axolotl_dist/{run}/where/{rank}"


def where_question(run: str) -> str:
    """The last question a holder of the run's secret asked (its time, sealed): a rank answers
    a request only while it is recent (runs with a secret)."""
    return f"axolotl_dist/{run}/ask"


def long_wait(run: str, rank: int) -> str:
    """The description of global ``rank``'s long kit wait (empty while none runs long)."""
    return f"axolotl_dist/{run}/wait/{rank}"


def stuck(run: str, rank: int) -> str:
    """The stall detector's mark while global ``rank``'s wait can never end."""
    return f"axolotl_dist/{run}/stuck/{rank}"


def stuck_report(run: str, group: str, seq: int, round_: int) -> str:
    """Which rank reports the run stuck in torch's collective ``#seq`` of process group
    ``group`` (the ``round_``-th report of it): the first rank to write its number."""
    return f"axolotl_dist/{run}/stuck_report/{group.replace('/', '_')}/{seq}/{round_}"


def arrivals(run: str, rank: int) -> str:
    """When global ``rank`` issued its last collectives before the latest round's moment, per
    process group (the straggler report; overwritten each round)."""
    return f"axolotl_dist/{run}/arrivals/{rank}"


def straggler(run: str) -> str:
    """Rank 0's latest straggler finding (empty: none), for ``straggler_report()`` elsewhere."""
    return f"axolotl_dist/{run}/straggler"


# --- attempts of a restarted run (root keys, in a store that outlives them) -------------------

#: A counter: the attempts of this run that began, each numbered by rank 0's ``add``.
ATTEMPTS = "axolotl_dist/attempt"


def attempt_join(rank: int) -> str:
    """The token global ``rank`` drew for the attempt it is starting (its newest)."""
    return f"{ATTEMPTS}/join/{rank}"


def attempt_answer(rank: int, token: str) -> str:
    """Rank 0's answer to global ``rank``'s ``token``: the attempt's number."""
    return f"{ATTEMPTS}/answer/{rank}/{token}"


def attempt_joined(attempt: int, rank: int) -> str:
    """Set when global ``rank`` took attempt ``attempt``'s number."""
    return f"{ATTEMPTS}/{attempt}/joined/{rank}"


def attempt_prefix(attempt: int) -> str:
    """Where attempt ``attempt`` keeps everything else: torch's bootstrap of the group the kit
    creates, and (under it) every group key of the kit."""
    return f"{ATTEMPTS}/{attempt}"


# --- torch's rendezvous keys, read by ``axolotl-dist where`` ------------------------------------

#: A torch elastic rendezvous (torchrun's ``--rdzv-backend c10d``) leaves the ranks' own store's
#: address in its store, per round: ``torch.rendezvous.<run id>.<round>/MASTER_PORT`` (and
#: ``/MASTER_ADDR``).
_RDZV, _PORT, _ADDR = "torch.rendezvous.", "/MASTER_PORT", "/MASTER_ADDR"


def rendezvous_prefix(run_id: str, round_: int) -> str:
    """Round ``round_`` of torch's rendezvous ``run_id``."""
    return f"{_RDZV}{run_id}.{round_}"


def rendezvous_port(prefix: str) -> str:
    """The key of a rendezvous round's ``MASTER_PORT``."""
    return prefix + _PORT


def rendezvous_addr(prefix: str) -> str:
    """The key of a rendezvous round's ``MASTER_ADDR``."""
    return prefix + _ADDR


def is_rendezvous_port(key: str) -> bool:
    """Whether ``key`` is a rendezvous round's ``MASTER_PORT``."""
    return key.startswith(_RDZV) and key.endswith(_PORT)


def rendezvous_round(port_key: str) -> str:
    """The round (its prefix) of a :func:`rendezvous_port` key."""
    return port_key[: -len(_PORT)]


#: Every key as docs/design/store.md's table spells it (placeholders in angle brackets).
DOCUMENTED = (
    RUN, RUN_NOTE, who("<run>", "<rank>"), heartbeat("<run>", "<rank>"),  # type: ignore[arg-type]
    dead("<run>"),
    where_answer("<run>", "<rank>"), where_question("<run>"),  # type: ignore[arg-type]
    long_wait("<run>", "<rank>"),  # type: ignore[arg-type]
    stuck("<run>", "<rank>"), stuck_report("<run>", "<group>", "<seq>", "<n>"),  # type: ignore[arg-type]
    arrivals("<run>", "<rank>"), straggler("<run>"),  # type: ignore[arg-type]
    deadlock("<h>"), ack(deadlock("<h>"), "<rank>"),  # type: ignore[arg-type]
    exit_record("<rank>"), EXIT_LOG, EXITS, WAITERS, STALL_REPORT, WARN_LOG,  # type: ignore[arg-type]
    exit_pending("<rank>"), waiting("<rank>"), ack(exit_record("<rank>"), "<reader>"),  # type: ignore[arg-type]
    gone("<rank>"), block("zf", "<seq>"), shared_fs("<h>"), block("dn", "<seq>"),  # type: ignore[arg-type]
    block("ck", "<seq>"),
    debug_check("<seq>"), shared_map("<seq>"), clock("<rank>", "<i>", "<side>"),  # type: ignore[arg-type]
    ATTEMPTS, attempt_join("<rank>"), attempt_answer("<rank>", "<token>"),  # type: ignore[arg-type]
    attempt_joined("<a>", "<rank>"), attempt_prefix("<a>"),  # type: ignore[arg-type]
)


#: The keys the kit counts in (``add``; no seal): their tails, under any prefix.
_COUNTERS = re.compile(
    r"(^|/)(axd/(exits|waiters|waiting/\d+|(zf|dn|ck)/\d+/[0-9a-f]{10}(/\d+)?|fs/[0-9a-f]+/seen"
    r"|dbg/\d+/(n|d/[^/]+)|sm/\d+/(arrived|progress|done|failed|left(/.*)?))"
    r"|axolotl_dist/[^/]+/hb/\d+|axolotl_dist/attempt)$")


def is_counter(key: str) -> bool:
    """Whether ``key`` (as a store lists it, under any prefix) is one the kit counts in."""
    return _COUNTERS.search(key) is not None


def as_named(listed: str) -> str:
    """A key as a store lists it (under its prefixes), as the kit names it: from its ``axd/``
    on (a group key, under an attempt's prefix too), else from ``axolotl_dist/``."""
    for head in ("axd/", "axolotl_dist/"):
        if head in listed:
            return listed[listed.index(head):]
    return listed
