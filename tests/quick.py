"""The quick set, ``python -m pytest -m quick``: a maintainer's loop in under 3 minutes.

It is every unit test (the trees in ``UNIT_TREES``, which start no process) and the
integration tests below, chosen so that every module of the package has at least one of them
going through it: ``scripts/quick_cover.py`` measures that with coverage.py (forked ranks and
launched processes included) and writes ``tests/quick_map.py``; ``tests/test_structure.py``
fails while a module of the package has no quick test there. ``tests/conftest.py`` marks the
tests. The whole suite (the README's test command) still runs everything.
"""

from __future__ import annotations

from typing import Tuple

__all__ = ["UNIT_TREES", "INTEGRATION", "STATIC"]

#: Test trees of unit tests: every test in them is quick.
UNIT_TREES: Tuple[str, ...] = ("tests/runtime", "tests/launch", "tests/env")

#: Integration tests of the quick set (pytest node ids; one without ``[...]`` takes every
#: parametrization). Cheap ones first: forked ranks, then one launch per launcher path.
INTEGRATION: Tuple[str, ...] = (
    # values, collectives, ordering, the rank queries (forked ranks)
    "tests/test_values.py::test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values[store-parent-3]",
    "tests/test_collectives.py::test_collectives_on_a_subgroup_are_group_relative",
    "tests/test_zero_only.py::test_zero_only_decorator_runs_on_rank0_only[ranks2]",
    "tests/test_ordering.py::test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished[store-rank0]",
    "tests/test_queries.py::test_get_attempt_after_init_is_agreed_through_an_agents_store[parent]",
    "tests/test_queries.py::test_composer_style_env_two_nodes[after-init]",
    "tests/test_errors.py::test_bad_launcher_env_is_named_with_the_fix",
    "tests/test_init.py::test_helpers_after_cleanup_and_a_new_group",
    "tests/test_pairing.py::test_a_broadcast_meeting_another_helper_or_source_is_named_by_every_rank[3]",
    "tests/test_pairing.py::test_a_loop_of_blocks_keeps_the_key_count_flat[store-parent-2]",
    "tests/test_shape_checks.py::test_every_mismatch_raises_on_every_rank_within_seconds[3-rank0]",
    "tests/test_porting.py::test_accelerates_gather_for_metrics_and_the_kits_keep_the_same_rows",
    "tests/test_porting.py::test_every_helper_gives_what_accelerates_gives[3]",
    "tests/test_accelerator_branches.py::test_each_helper_reads_no_device_tensor_and_gives_the_cpu_result[2]",
    "tests/test_accelerator_branches.py::test_a_mismatch_on_the_accelerator_branch_is_named_on_every_rank[3]",
    "tests/test_debug.py::test_all_reduce_of_different_shapes_is_the_shape_checks_error_in_debug_mode_too[store-parent-3]",
    "tests/test_threads.py::test_a_block_opened_while_another_thread_has_one_open_is_a_named_error[store-parent-2]",
    "tests/test_process.py::test_local_rank_zero_failure_raises_on_the_waiting_ranks_instead_of_hanging",
    "tests/test_process.py::test_ordered_blocks_on_two_nodes",
    "tests/test_process.py::test_tqdm_and_print_show_on_the_main_process_only",
    "tests/test_logging.py::test_get_logger_main_only_with_rank_prefix_and_no_side_effects",
    "tests/test_data.py::test_split_between_processes_reassembles[True]",
    "tests/test_parallel.py::test_fake_1024_ranks_pp_dp_tp_and_hsdp_ep",
    "tests/test_parallel.py::test_build_errors_name_the_config_and_numbers",
    "tests/test_tensors.py::test_dtensor_utils_agree_with_dtensor_on_2x2_mesh",
    "tests/test_tensors.py::test_round_trips_on_gloo[3]",
    "tests/test_tensors.py::test_sharded_parameter_training_step_matches_reference[2]",
    "tests/test_parallel.py::test_two_stage_pipeline_matches_the_plain_model",
    "tests/test_checkpoints.py::test_a_checkpoint_is_committed_once_every_rank_wrote_it[3]",
    "tests/test_faults.py::test_a_caught_failure_keeps_no_frames_alive_and_is_still_relayed[killed]",
    "tests/test_faults.py::test_a_gone_store_host_is_known_without_a_store_call[rank0]",
    "tests/test_where.py::test_a_collective_inside_a_first_run_block_is_an_error_on_every_rank[store-parent-barrier-3]",
    "tests/test_where.py::test_the_first_wait_warning_says_where_the_awaited_ranks_are[store-parent]",
    "tests/test_cache_note.py::test_in_memory_map_in_the_block_is_noted_once_on_rank_0_with_the_fix[zero_first]",
    "tests/test_shared_map.py::test_same_result_as_one_process_and_each_rank_maps_its_part[batched-with-indices-3]",
    "tests/test_shared_map.py::test_a_killed_rank_is_noticed_and_its_part_recomputed_next_time",
    "tests/test_pytest_plugin.py::test_a_session_without_the_marker_imports_no_torch[installed]",
    "tests/test_records_fuzz.py::test_failure_reports_refuse_what_the_kit_did_not_write",
    "tests/test_straggler_report.py::test_straggler_report_on_forked_ranks_is_none_at_once_while_rank_0_found_nothing",
    "tests/test_hosts.py::test_checkpoints_on_private_disks_commit_per_node_or_say_what_to_do",
    # the launcher, launched: one run per path
    "tests/test_launch.py::test_version_and_help_say_what_the_cli_has",
    "tests/test_launch.py::test_three_ranks_env_and_a_raising_rank",
    "tests/test_restarts.py::test_attempt_1_runs_clean_after_attempt_0_failed[raise_in_zero_first-axolotl-dist]",
    "tests/test_output.py::test_a_traceback_comes_out_whole_and_the_report_points_to_it",
    "tests/test_local_channels.py::test_another_users_where_makes_nothing",
    "tests/test_launch_geometry.py::test_a_valid_launch_starts[srun -n2]",
    "tests/test_warnings_fold.py::test_three_ranks_with_bare_env_vars_and_the_store_in_rank_0",
    "tests/test_trace.py::test_the_cli_merges_again_and_tracing_off_writes_nothing",
    "tests/test_stuck_collectives.py::test_where_gives_the_verdict_on_torchs_collectives[ddp-axolotl-dist-2]",
)

#: Checks that read the sources and start nothing: quick, but they go through no module.
STATIC: Tuple[str, ...] = (
    "tests/test_structure.py",
    "tests/test_docs.py::test_every_link_resolves",
    "tests/test_docs.py::test_the_env_table_lists_exactly_the_variables_the_code_reads",
)
