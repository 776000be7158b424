"""The kit's core helpers on the ranks of one launch, in whatever install runs it.

Run by ``scripts/compat.sh`` (``axolotl-dist -n 2 scripts/core_check.py``) in fresh venvs: the
README's install line alone (no extras, so no NumPy), a wheel, PyPI's CUDA build of torch on a
machine without a GPU, and the oldest torch ``setup.cfg`` admits. It asserts what each helper
returns; the script that launches it asserts that nobody printed a NumPy warning.
"""

import os
import sys
import tempfile

import axolotl_dist as ad  # before torch: the kit silences torch's import-time NumPy notice

import torch  # noqa: E402


def main() -> None:
    ad.init_distributed()
    rank, world = ad.get_rank(), ad.get_world_size()
    assert ad.default_backend() == "gloo", ad.default_backend()  # no usable GPU here
    assert ad.get_backend() == "gloo", ad.get_backend()

    value = ad.compute_and_broadcast(lambda: {"a": 1, "rank": rank, "big": 2**70})
    assert value == {"a": 1, "rank": 0, "big": 2**70}, value
    assert ad.reduce_and_broadcast(lambda: 16_777_217 + rank, sum) == \
        sum(16_777_217 + r for r in range(world))
    gathered = ad.gather_from_all_ranks(lambda: (rank, 0.1 * rank))  # a list on rank 0 only
    assert gathered == ([(r, 0.1 * r) for r in range(world)] if rank == 0 else None), gathered
    tensor = ad.compute_and_broadcast(lambda: torch.arange(5, dtype=torch.float64) * (rank + 1))
    assert torch.equal(tensor, torch.arange(5, dtype=torch.float64)), tensor

    marker = os.path.join(tempfile.gettempdir(), f"axolotl_dist_core_check_{os.environ['MASTER_PORT']}")
    with ad.zero_first():
        if rank == 0:
            with open(marker, "w") as fh:
                fh.write("built by rank 0")
    with open(marker) as fh:  # the others entered only after rank 0's body ended
        assert fh.read() == "built by rank 0"
    ad.barrier()
    if rank == 0:
        os.remove(marker)

    try:  # a failing first rank is named on the others (its report crosses as bytes)
        ad.compute_and_broadcast(lambda: 1 // 0)
    except ZeroDivisionError:
        assert rank == 0
    except ad.RankFailedError as exc:
        assert rank != 0 and exc.rank == 0 and "ZeroDivisionError" in str(exc), exc
    else:
        raise AssertionError("compute_and_broadcast of 1 // 0 returned")

    print(f"core check passed: rank {rank}/{world}, torch {torch.__version__}, "
          f"numpy {'imported' if 'numpy' in sys.modules else 'absent'}", flush=True)


if __name__ == "__main__":
    main()
