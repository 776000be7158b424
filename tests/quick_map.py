"""Which quick tests go through each module of the package: written by
scripts/quick_cover.py (measured with coverage.py), read by tests/test_structure.py.
Do not edit: add a test to tests/quick.py and run the script."""

GOES_THROUGH = {
    'axolotl_dist/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/args.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
    ),
    'axolotl_dist/_runtime/base/backends.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/callsite.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/constants.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
    ),
    'axolotl_dist/_runtime/base/groups.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/hooks.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/kitlog.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/mapped_file.py': (
        'tests/test_trace.py::test_the_cli_merges_again_and_tracing_off_writes_nothing',
    ),
    'axolotl_dist/_runtime/base/pickling.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/private.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/procs.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/state.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/base/text.py': (
        'tests/test_logging.py::test_get_logger_main_only_with_rank_prefix_and_no_side_effects',
        'tests/test_checkpoints.py::test_a_checkpoint_is_committed_once_every_rank_wrote_it[3]',
        'tests/test_where.py::test_the_first_wait_warning_says_where_the_awaited_ranks_are[store-parent]',
    ),
    'axolotl_dist/_runtime/base/torch_messages.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_porting.py::test_every_helper_gives_what_accelerates_gives[3]',
    ),
    'axolotl_dist/_runtime/base/tracebacks.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/lifecycle_state.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/repeat_failure.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/services.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/startup.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/teardown.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/lifecycle/warnfold.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/dead_peers.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/deadlock.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/failures.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/flight.py': (
        'tests/test_debug.py::test_all_reduce_of_different_shapes_is_the_shape_checks_error_in_debug_mode_too[store-parent-3]',
        'tests/test_where.py::test_the_first_wait_warning_says_where_the_awaited_ranks_are[store-parent]',
        'tests/test_trace.py::test_the_cli_merges_again_and_tracing_off_writes_nothing',
    ),
    'axolotl_dist/_runtime/liveness/heartbeat.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/liveness_state.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/lost.py': (
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_faults.py::test_a_caught_failure_keeps_no_frames_alive_and_is_still_relayed[killed]',
        'tests/test_faults.py::test_a_gone_store_host_is_known_without_a_store_call[rank0]',
    ),
    'axolotl_dist/_runtime/liveness/peers.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/polls.py': (
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
        'tests/test_threads.py::test_a_block_opened_while_another_thread_has_one_open_is_a_named_error[store-parent-2]',
    ),
    'axolotl_dist/_runtime/liveness/progress.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/runs.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/scopes.py': (
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
    ),
    'axolotl_dist/_runtime/liveness/stalls.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/stragglers.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/stuck.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/waits.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/liveness/where_report.py': (
        'tests/test_where.py::test_the_first_wait_warning_says_where_the_awaited_ranks_are[store-parent]',
    ),
    'axolotl_dist/_runtime/protocols/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/blocks.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/checkpointing.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/codes.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/debug_checks.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/encoding.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
    ),
    'axolotl_dist/_runtime/protocols/exchange.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/headers.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/helpers.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/leases.py': (
        'tests/test_checkpoints.py::test_a_checkpoint_is_committed_once_every_rank_wrote_it[3]',
    ),
    'axolotl_dist/_runtime/protocols/map_cache.py': (
        'tests/test_cache_note.py::test_in_memory_map_in_the_block_is_noted_once_on_rank_0_with_the_fix[zero_first]',
    ),
    'axolotl_dist/_runtime/protocols/packets.py': (
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_shape_checks.py::test_every_mismatch_raises_on_every_rank_within_seconds[3-rank0]',
        'tests/test_porting.py::test_accelerates_gather_for_metrics_and_the_kits_keep_the_same_rows',
    ),
    'axolotl_dist/_runtime/protocols/protocols_state.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/raw_checks.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/rounds.py': (
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
    ),
    'axolotl_dist/_runtime/protocols/shared_fs.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/threads.py': (
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
        'tests/test_threads.py::test_a_block_opened_while_another_thread_has_one_open_is_a_named_error[store-parent-2]',
    ),
    'axolotl_dist/_runtime/protocols/timeline.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/protocols/unchecked.py': (
        'tests/test_debug.py::test_all_reduce_of_different_shapes_is_the_shape_checks_error_in_debug_mode_too[store-parent-3]',
    ),
    'axolotl_dist/_runtime/protocols/zero_first.py': (
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]',
        'tests/test_threads.py::test_a_block_opened_while_another_thread_has_one_open_is_a_named_error[store-parent-2]',
    ),
    'axolotl_dist/_runtime/store/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/access.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/attempts.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/clients.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/keys.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/records.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/seals.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/store_state.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/sweep.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/_runtime/store/wakeup.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/checkpoints.py': (
        'tests/test_checkpoints.py::test_a_checkpoint_is_committed_once_every_rank_wrote_it[3]',
    ),
    'axolotl_dist/collectives.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/data.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/debug.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/distributed.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/env/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/env/geometry.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/env/slurm.py': (
        'tests/test_launch_geometry.py::test_a_valid_launch_starts[srun -n2]',
    ),
    'axolotl_dist/env/variables.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/errors.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/hf_data/__init__.py': (
        'tests/test_shared_map.py::test_same_result_as_one_process_and_each_rank_maps_its_part[batched-with-indices-3]',
        'tests/test_shared_map.py::test_a_killed_rank_is_noticed_and_its_part_recomputed_next_time',
    ),
    'axolotl_dist/hf_data/_parts.py': (
        'tests/test_shared_map.py::test_same_result_as_one_process_and_each_rank_maps_its_part[batched-with-indices-3]',
        'tests/test_shared_map.py::test_a_killed_rank_is_noticed_and_its_part_recomputed_next_time',
    ),
    'axolotl_dist/initialize.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/launch/__init__.py': (
        'tests/test_launch.py::test_version_and_help_say_what_the_cli_has',
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
    ),
    'axolotl_dist/launch/__main__.py': (
        'tests/test_launch.py::test_version_and_help_say_what_the_cli_has',
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
    ),
    'axolotl_dist/launch/_fold.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_loopback.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_options.py': (
        'tests/test_launch.py::test_version_and_help_say_what_the_cli_has',
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
    ),
    'axolotl_dist/launch/_output.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_rank_logs.py': (
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_rank_main.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_report.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_restarts.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_watch.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/launch/_where.py': (
        'tests/test_launch.py::test_version_and_help_say_what_the_cli_has',
        'tests/test_trace.py::test_the_cli_merges_again_and_tracing_off_writes_nothing',
    ),
    'axolotl_dist/log.py': (
        'tests/test_logging.py::test_get_logger_main_only_with_rank_prefix_and_no_side_effects',
    ),
    'axolotl_dist/metrics.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/operations.py': (
        'tests/test_shape_checks.py::test_every_mismatch_raises_on_every_rank_within_seconds[3-rank0]',
        'tests/test_porting.py::test_accelerates_gather_for_metrics_and_the_kits_keep_the_same_rows',
        'tests/test_porting.py::test_every_helper_gives_what_accelerates_gives[3]',
    ),
    'axolotl_dist/ordering.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/parallel/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/parallel/config.py': (
        'tests/test_parallel.py::test_fake_1024_ranks_pp_dp_tp_and_hsdp_ep',
        'tests/test_parallel.py::test_build_errors_name_the_config_and_numbers',
        'tests/test_parallel.py::test_two_stage_pipeline_matches_the_plain_model',
    ),
    'axolotl_dist/parallel/mesh.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/parallel/pipeline.py': (
        'tests/test_parallel.py::test_two_stage_pipeline_matches_the_plain_model',
    ),
    'axolotl_dist/partial_state.py': (
        'tests/test_porting.py::test_every_helper_gives_what_accelerates_gives[3]',
    ),
    'axolotl_dist/process.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/ranks.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/reports.py': (
        'tests/test_straggler_report.py::test_straggler_report_on_forked_ranks_is_none_at_once_while_rank_0_found_nothing',
    ),
    'axolotl_dist/seeding.py': (
        'tests/test_porting.py::test_every_helper_gives_what_accelerates_gives[3]',
    ),
    'axolotl_dist/tensors/__init__.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/tensors/_flat_comm.py': (
        'tests/test_tensors.py::test_round_trips_on_gloo[3]',
        'tests/test_tensors.py::test_sharded_parameter_training_step_matches_reference[2]',
    ),
    'axolotl_dist/tensors/dtensor_utils.py': (
        'tests/test_tensors.py::test_dtensor_utils_agree_with_dtensor_on_2x2_mesh',
    ),
    'axolotl_dist/tensors/sharded_flat_tensor.py': (
        'tests/test_tensors.py::test_round_trips_on_gloo[3]',
        'tests/test_tensors.py::test_sharded_parameter_training_step_matches_reference[2]',
    ),
    'axolotl_dist/tensors/sharding_spec.py': (
        'tests/test_tensors.py::test_round_trips_on_gloo[3]',
        'tests/test_tensors.py::test_sharded_parameter_training_step_matches_reference[2]',
    ),
    'axolotl_dist/testing/__init__.py': (
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/testing/_harness.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/testing/_marked.py': (
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/testing/_outcomes.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/testing/_probes.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/testing/_rank.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
    'axolotl_dist/tracing/__init__.py': (
        'tests/test_launch.py::test_three_ranks_env_and_a_raising_rank',
        'tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]',
        'tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it',
    ),
    'axolotl_dist/tracing/_merge.py': (
        'tests/test_trace.py::test_the_cli_merges_again_and_tracing_off_writes_nothing',
    ),
    'axolotl_dist/tracing/_picture.py': (
        'tests/test_trace.py::test_the_cli_merges_again_and_tracing_off_writes_nothing',
    ),
    'axolotl_dist/values.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]',
        'tests/test_init.py::test_helpers_after_cleanup_and_a_new_group',
    ),
    'pytest_axolotl_dist.py': (
        'tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]',
        'tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative',
        'tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]',
    ),
}
