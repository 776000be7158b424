"""The thin functional layer: every distributed helper of the kit under one module.

This module only re-exports; the code lives in small modules a reader would guess:

* :mod:`axolotl_dist.env`: the launcher env contract (``RANK``, ``WORLD_SIZE``, SLURM, MPI);
* :mod:`axolotl_dist.ranks`: rank and size queries, before and after init, without side effects;
* :mod:`axolotl_dist.initialize`: ``init_distributed`` / ``initialize_dist`` / cleanup;
* :mod:`axolotl_dist.collectives`: tensor collectives (composer's names);
* :mod:`axolotl_dist.values`: exact value helpers (axolotl's and OLMo-core's names);
* :mod:`axolotl_dist.ordering`: ``zero_first``, ``zero_only``, ``do_n_at_a_time``;
* :mod:`axolotl_dist.data`: ``get_sampler``, ``split_between_processes``;
* :mod:`axolotl_dist.hf_data`: ``shared_map``, a Hugging Face ``datasets.map`` split across
  ranks (needs the ``datasets`` extra only when called);
* :mod:`axolotl_dist.log`: ``get_logger``;
* :mod:`axolotl_dist.process`: Accelerate- and composer-style names: ``main_process_first``,
  ``run_local_rank_zero_first``, ``on_main_process``-style decorators, ``tqdm``, ``print``;
* :mod:`axolotl_dist.operations`: accelerate's ``gather``, ``gather_object``, ``reduce``,
  ``pad_across_processes``, ``copy_tensor_to_devices``; :mod:`axolotl_dist.metrics`:
  ``gather_for_metrics``; :mod:`axolotl_dist.partial_state`: ``PartialState``,
  ``DistributedType``, ``wait_for_everyone``;
  :mod:`axolotl_dist.seeding`: ``set_seed`` (docs/porting.md maps accelerate's names);
* :mod:`axolotl_dist.debug`: debug mode (``AXOLOTL_DIST_DEBUG=1``), which checks every
  helper call across ranks;
* :mod:`axolotl_dist.tracing`: the cross-rank timeline (``AXOLOTL_DIST_TRACE=<dir>``,
  ``trace_span``, ``merge_trace``).
"""

from __future__ import annotations

from .checkpoints import checkpoint_dir, latest_checkpoint
from .collectives import all_gather, all_reduce, barrier, broadcast
from .debug import debug_mode, disable_debug, enable_debug, is_debug_enabled
from .data import get_sampler, split_between_processes
from .env import validate_env_vars
from .hf_data import shared_map
from .initialize import (cleanup_distributed, default_backend, get_attempt, init_distributed,
                         initialize_dist)
from .log import get_logger
from .metrics import gather_for_metrics, reset_metrics_count
from .operations import (copy_tensor_to_devices, gather, gather_object, pad_across_processes,
                         reduce)
from .partial_state import DistributedType, PartialState, wait_for_everyone
from .seeding import set_seed
from .ordering import do_n_at_a_time, zero_first, zero_only
from .process import (
    ProgressBar,
    local_main_process_first,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_local_process,
    on_main_process,
    on_process,
    print,
    run_local_rank_zero_first,
    tqdm,
)
from .reports import StragglerReport, straggler_report
from .tracing import is_tracing, merge_trace, trace_span
from .ranks import (
    backend_supports_cpu,
    backend_supports_cuda,
    get_backend,
    get_fs_local_rank,
    get_global_rank,
    get_group_rank,
    get_local_rank,
    get_local_world_size,
    get_mesh_coordinates,
    get_node_rank,
    get_num_nodes,
    get_rank,
    get_world_size,
    is_available,
    is_distributed,
    is_initialized,
    is_last_process,
    is_local_main_process,
    is_main_process,
)
from .values import (
    all_gather_object,
    all_reduce_value,
    broadcast_object,
    broadcast_object_list,
    compute_and_broadcast,
    gather_from_all_ranks,
    gather_scalar_from_all_ranks,
    reduce_and_broadcast,
    synchronize_flag,
    synchronize_value,
)

__all__ = [
    # queries
    "is_available", "is_initialized", "is_distributed", "get_rank", "get_world_size",
    "get_global_rank", "get_group_rank", "get_local_rank", "get_local_world_size",
    "get_node_rank", "get_num_nodes", "get_attempt", "get_fs_local_rank", "is_main_process",
    "is_local_main_process", "is_last_process", "get_backend", "backend_supports_cuda", "backend_supports_cpu",
    "get_mesh_coordinates",
    # init
    "init_distributed", "initialize_dist", "validate_env_vars", "cleanup_distributed",
    "default_backend",
    # tensor collectives
    "barrier", "broadcast", "all_reduce", "all_gather", "all_gather_object",
    "broadcast_object_list", "broadcast_object",
    # value helpers
    "synchronize_value", "synchronize_flag", "all_reduce_value", "compute_and_broadcast",
    "gather_from_all_ranks", "gather_scalar_from_all_ranks", "reduce_and_broadcast",
    # rank-ordered blocks
    "zero_first", "zero_only", "do_n_at_a_time",
    # checkpoints
    "checkpoint_dir", "latest_checkpoint",
    # Accelerate / composer style
    "main_process_first", "local_main_process_first", "run_local_rank_zero_first",
    "on_main_process", "on_local_main_process", "on_last_process", "on_process",
    "on_local_process", "tqdm", "ProgressBar",
    # accelerate's operations and state (docs/porting.md)
    "gather", "gather_object", "reduce", "pad_across_processes", "copy_tensor_to_devices",
    "gather_for_metrics", "reset_metrics_count", "PartialState", "DistributedType",
    "wait_for_everyone", "set_seed",
    # not "print": `from axolotl_dist import *` must never shadow the builtin (use ad.print)
    # data and logging
    "get_sampler", "split_between_processes", "get_logger", "shared_map",
    # debug mode
    "enable_debug", "disable_debug", "is_debug_enabled", "debug_mode",
    # the timeline
    "trace_span", "is_tracing", "merge_trace",
    # the straggler report
    "straggler_report", "StragglerReport",
]
