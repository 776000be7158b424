"""Unit tests of the launcher's folding (``launch/_fold.py``): lines fed per rank with their
times, what comes out. No process; times are given, not waited for."""

from __future__ import annotations

from typing import List, Tuple

import pytest

from axolotl_dist.launch._fold import WINDOW, Folder, _labelled, _parse


def run(lines: List[Tuple[int, bytes]], ranks: int = 2) -> List[bytes]:
    """Feed each ``(rank, line)`` on stderr at time 0, then let the window pass."""
    folder = Folder(ranks, {1: False, 2: False})
    for rank, line in lines:
        folder.feed(rank, 2, line + b"\n", 0.0)
    folder.tick(WINDOW + 1.0)
    folder.flush()
    return b"".join(data for _, data in folder.take()).splitlines()


def test_a_line_every_rank_printed_alike_is_one_line_with_the_ranks():
    assert run([(0, b"loading shard"), (1, b"loading shard")]) == [b"[ranks 0, 1] loading shard"]


def test_lines_alike_but_for_the_time_and_the_tag_fold_as_the_first_ranks():
    shown = run([(0, b"12:00:01 INFO axolotl_dist: [rank 0/2] waiting"),
                 (1, b"12:00:02 INFO axolotl_dist: [rank 1/2] waiting")])
    assert shown == [b"12:00:01 INFO axolotl_dist: [ranks 0, 1/2] waiting"]


def test_different_lines_keep_their_ranks_and_each_ranks_order():
    shown = run([(0, b"a"), (1, b"b"), (0, b"c")])
    assert shown == [b"[rank 0] a", b"[rank 1] b", b"[rank 0] c"]


def test_a_traceback_comes_out_whole_with_its_rank():
    tb = [b"[rank1]: Traceback (most recent call last):", b'[rank1]:   File "x.py", line 3',
          b"[rank1]: ValueError: boom"]
    shown = run([(1, line) for line in tb])
    assert shown == [b"[rank 1] Traceback (most recent call last):",
                     b'[rank 1]   File "x.py", line 3', b"[rank 1] ValueError: boom"]


@pytest.mark.parametrize("line, ranks, shown", [
    (b"[rank1]: Traceback (most recent call last):", [1],
     b"[rank 1] Traceback (most recent call last):"),
    (b"[rank0]:[W1126 21:40:08.1 a.cpp:1] Warning: w", [0, 1],
     b"[ranks 0, 1] [W1126 21:40:08.1 a.cpp:1] Warning: w"),
    (b"12:00:01 INFO axolotl_dist: [rank 1/4] waiting", [1],
     b"12:00:01 INFO axolotl_dist: [rank 1/4] waiting"),
    (b"12:00:01 INFO axolotl_dist: [rank 1/4] waiting", [1, 2],
     b"12:00:01 INFO axolotl_dist: [ranks 1, 2/4] waiting"),
    (b"plain", [2], b"[rank 2] plain"),
])
def test_one_form_of_label_torchs_tag_in_the_launchers_form(line, ranks, shown):
    assert _labelled(line, _parse(line)[1], ranks, ranks[0]) == shown


def test_the_key_ignores_the_time_the_tag_and_a_cpp_logs_time_and_pid():
    a = _parse(b"[rank0]:[W1126 21:40:08.123456789 123 reducer.cpp:1529] Warning: x")[0]
    b = _parse(b"[rank1]:[W1126 21:40:09.987654321 456 reducer.cpp:1529] Warning: x")[0]
    c = _parse(b"[rank1]:[E1126 21:40:09.987654321 456 reducer.cpp:1529] Warning: x")[0]
    assert a == b and a != c  # the severity still counts


#: A C++ error torch logs as a warning (a store connection the server closed): the log line,
#: then the block of frames c10 appends to the error's text, then a blank line.
CPP_WARNING = [b"[W1129 05:50:11.798447548 TCPStore.cpp:125] [c10d] recvValue failed: closed",
               b"Exception raised from recvBytes at /src/c10d/Utils.hpp:787 (most recent call "
               b"first):",
               b"frame #0: c10::Error::Error(c10::SourceLocation) + 0x9d (0x7f in libc10.so)",
               b"frame #1: <unknown function> + 0x67483cd (0x7f in libtorch_cpu.so)",
               b"<omitting python frames>",
               b"frame #20: __libc_start_main + 0x85 (0x7f in libc.so.6)",
               b""]
FOLDED_CPP = (b"Exception raised from recvBytes at /src/c10d/Utils.hpp:787 (its C++ frames are "
              b"not shown: --log-dir keeps them)")


def test_a_block_of_cpp_frames_is_one_line_naming_its_first():
    shown = run([(0, line) for line in CPP_WARNING + [b"after"]] +
                [(1, line) for line in CPP_WARNING])
    assert b"[ranks 0, 1] " + FOLDED_CPP in shown, shown
    assert not any(b"frame #" in line or b"omitting" in line for line in shown), shown
    mine = [line for line in shown if line.startswith(b"[rank 0]") or b"0, 1" in line]
    assert mine[-1] == b"[rank 0] after"  # its order kept


def test_a_cpp_block_names_the_ranks_log_file_and_ends_a_python_traceback(tmp_path):
    folder = Folder(2, {1: False, 2: False}, log_dir=str(tmp_path))
    lines = [b"Traceback (most recent call last):", b"ValueError: boom"] + CPP_WARNING
    for line in lines:
        folder.feed(1, 2, line + b"\n", 0.0)
    folder.flush()
    shown = b"".join(data for _, data in folder.take()).splitlines()
    assert shown[:3] == [b"[rank 1] Traceback (most recent call last):",
                         b"[rank 1] ValueError: boom", b"[rank 1] " + CPP_WARNING[0]]
    assert shown[3] == (b"[rank 1] Exception raised from recvBytes at /src/c10d/Utils.hpp:787 "
                        b"(its C++ frames are in " + str(tmp_path / "rank1.log").encode() + b")")
    assert len(shown) == 4, shown


def test_no_fold_keeps_the_cpp_frames():
    folder = Folder(2, {1: False, 2: False}, fold=False, fold_cpp=False)
    for line in CPP_WARNING:
        folder.feed(0, 2, line + b"\n", 0.0)
    folder.flush()
    assert b"".join(data for _, data in folder.take()).splitlines() == CPP_WARNING
