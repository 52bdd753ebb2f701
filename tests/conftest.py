"""What the tests share: the environment every test and launched rank sees, toy data written once per
session, and the rank pool that starts ranks in seconds (tests/launching.py says when to use which).

Stand-in loaders, the toy config and its Trainer are in tests/stand_ins.py; launches in tests/launching.py.
"""

import contextlib
import functools
import os
import time

# nothing may reach the hub; set before anything imports huggingface_hub (which reads it once), and the
# same for every launched rank and the rank pool's server
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
from launching import REPO, launcher_env, venv_bin_first  # noqa: E402

# this venv's bin first on PATH for the whole session, as `make test` and every real launch have it: for
# in-process ranks and the rank pool's too. With the system's ninja first (another version, another hash
# of the same command) DeepSpeed rebuilt its CPU comm op, ~45 s, at every switch between a rank of one
# PATH and a rank of the other
os.environ["PATH"] = venv_bin_first(os.environ.get("PATH", ""))


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """Ranks forked from one server that imported torch, DeepSpeed, open_clip and eva_fastclip once
    (tests/rank_pool.py): for launches where only N ranks matter, not the launcher."""
    from rank_pool import RankPool

    log = tmp_path_factory.mktemp("rank_pool") / "server.log"
    with RankPool(REPO, env=launcher_env(), log=log) as pool:
        yield pool


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """The launched runs' data: 64 training pairs of 32 px in 4 shards of 16, 8 validation and 8
    zero-shot images (eva_fastclip.data.write_toy_dataset), written once per session."""
    from eva_fastclip.data import write_toy_dataset

    root = tmp_path_factory.mktemp("toy_data")
    write_toy_dataset(root, num_train=64, num_val=8, num_zeroshot=8, image_size=32, samples_per_shard=16)
    return root


#: the in-process tests that take over ~2 s each on a 2-core machine (module::function, every parameter):
#: marked ``slow``, left out of the fast tier (``make test-fast``); ``make test`` runs them
SLOW = {
    "test_accumulation::test_the_logged_loss_is_the_mean_over_the_steps_micro_batches",
    "test_bench_convergence::test_plot_is_written",
    "test_benchmarks::test_accumulation_benchmark_runs_every_side_on_the_same_batch",
    "test_cached_step::test_four_micro_batches_take_the_step_of_one",
    "test_compiled::test_compiled_towers_take_the_eager_steps_resume_either_way_and_export",
    "test_compiled::test_compiled_graphs_capture_every_setting",
    "test_corrupt_data::test_a_resumed_run_logs_the_skips_of_the_whole_run",
    "test_corrupt_data::test_an_epoch_delivers_every_good_sample_and_counts_every_bad_one",
    "test_corrupt_data::test_skip_counts_go_on_after_a_resume",
    "test_data_wait::test_a_run_measures_its_wait_on_data",
    "test_datacomp::test_eval_suite_from_the_command_line_on_all_38_tasks",
    "test_epoch_coverage::test_an_epoch_draws_every_sample_once",
    "test_epoch_coverage::test_an_epoch_resumed_on_another_layout_draws_the_rest_once",
    "test_eval_results::test_a_resumed_run_appends_to_eval_results",
    "test_export_eva::test_eva02_b16_round_trips_through_the_open_clip_format",
    "test_export_eva::test_model_with_a_hugging_face_text_tower_exports_and_reloads",
    "test_flops::test_masked_vit_b16_matches_the_counter_with_patch_dropout_on",
    "test_flops::test_rn50_matches_the_counter",
    "test_flops::test_vit_b16_forward_and_backward_match_the_counter",
    "test_lamb_zero::test_one_rank_steps_are_per_tensor",
    "test_nonfinite::test_non_finite_steps_stop_the_run_and_keep_the_last_checkpoint",
    "test_resume::test_a_conversion_is_made_once_per_save",
    "test_resume::test_a_position_from_another_layout_resumes_at_shard_granularity",
    "test_resume::test_a_resumed_epoch_goes_on_exactly_where_it_stopped",
    "test_run_lock::test_a_reused_pid_and_a_silent_host_are_stale",
    "test_step_hooks::test_non_finite_step_changes_nothing",
    "test_run_lock::test_the_supervisor_returns_after_the_processes_its_command_left",
    "test_save_by_time::test_checkpoints_come_by_time",
    "test_throughput::test_a_run_logs_its_throughput",
    "test_train_images::test_the_fast_path_is_the_compose_on_the_same_samples_and_crops",
    "test_tune::test_an_out_of_memory_probe_frees_what_it_held",
    "test_tune::test_bad_requests_are_refused_before_any_probe",
    "test_tune::test_estimate_only_plans_the_laion_preset_for_8_and_32_gpus_keeping_its_batch",
    "test_tune::test_estimates_are_within_15_percent_of_the_measured_peaks",
    "test_winogavil::test_the_scoring_equals_datacomps_loop_on_tied_fp16_similarities",
}


#: modules of tests/launched/ that start no ranks, only a process at a time beside pytest's (a clean Python,
#: a CPU burner): ``make test`` runs them in the in-process stream, off the launched stream's long path
ONE_PROCESS_AT_A_TIME = {"tests/launched/test_export_isolated.py", "tests/launched/test_bench_data.py"}


if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    # two threads a test beside the other worker's ranks oversubscribe the cores: OpenMP's threads wait
    # for each other spinning, and every test and rank is slower than on one thread
    torch.set_num_threads(1)


#: the in-process modules that take longest (seconds on one core beside the launched stream, ``make test``
#: on the 2-core CI machine): handed out first, so that none is left to the end on one worker. The rest
#: take under 10 s each
LONGEST_IN_PROCESS = {
    "tests/test_tune.py": 110,
    "tests/test_cached_step.py": 105,
    "tests/test_compiled.py": 60,  # inductor's first compile, when its cache is cold
    "tests/test_resume.py": 55,
    "tests/test_nonfinite.py": 40,
    "tests/test_benchmarks.py": 31,
    "tests/launched/test_export_isolated.py": 30,
    "tests/launched/test_bench_data.py": 28,
    "tests/test_flops.py": 27,
    "tests/test_export_eva.py": 25,
    "tests/test_epoch_coverage.py": 20,
    "tests/test_corrupt_data.py": 18,
    "tests/test_throughput.py": 17,
    "tests/test_step_hooks.py": 17,
    "tests/test_temperature_rules.py": 16,
    "tests/test_data.py": 16,
    "tests/test_eva_checkpoint.py": 13,
    "tests/test_eval_results.py": 13,
    "tests/test_image_transform.py": 12,
}
#: the autogroup niceness of a worker running in-process tests (see _yield_to_launches)
IN_PROCESS_NICE = 10


def launches_ranks(nodeid: str) -> bool:
    """A test of the launched stream: a module of tests/launched/ that starts ranks."""
    module = nodeid.split("::", 1)[0]
    return module.startswith("tests/launched/") and module not in ONE_PROCESS_AT_A_TIME


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where it is not installed
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``make test``: ``-n 3``): one worker runs the launched tests one after another
    (their ranks take both cores in turns); the others the in-process tests, a module at a time, the
    longest first, in the time the launches leave (_yield_to_launches).
    (pytest-xdist's own ``--dist loadgroup`` does not group under pytest 9.2: its group names never reach
    the scheduler.)"""
    from xdist.scheduler import LoadScopeScheduling

    class LaunchedAndModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "launched" if launches_ranks(nodeid) else nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # the collection's order (pytest_collection_modifyitems)
    return LaunchedAndModules(config, log)


def pytest_runtest_setup(item):
    if os.environ.get("PYTEST_XDIST_WORKER") and not launches_ranks(item.nodeid):
        _yield_to_launches()


@functools.cache  # once a worker
def _yield_to_launches() -> None:
    """A worker of in-process tests gives the CPU to the launched stream's ranks first: it moves to a
    session of its own, whose autogroup it nices (Linux schedules each session's autogroup as one task,
    and every launch is a session of its own: the ranks' nice values alone do not count against another
    session), and nices itself for kernels without autogroups. Its tests then run on what the launches
    leave: the start-ups, the waits on a signal or a timeout, and both cores once the launches are done."""
    with contextlib.suppress(OSError):
        os.setsid()
        for _ in range(50):  # the kernel takes one autogroup change every 0.1 s (EAGAIN)
            try:
                with open("/proc/self/autogroup", "w") as autogroup:
                    autogroup.write(str(IN_PROCESS_NICE))
                break
            except BlockingIOError:
                time.sleep(0.1)
    os.nice(IN_PROCESS_NICE)


def pytest_collection_modifyitems(config, items):
    """Mark SLOW's tests ``slow``; the launched stream's tests first, then the in-process modules, the
    longest first (LONGEST_IN_PROCESS), each module's tests in their order."""
    order = {item.nodeid: i for i, item in enumerate(items)}

    def key(item):
        module = item.nodeid.split("::", 1)[0]
        return (not launches_ranks(item.nodeid), -LONGEST_IN_PROCESS.get(module, 0), order[item.nodeid])

    items.sort(key=key)
    named = set()
    for item in items:
        name = f"{item.path.stem}::{getattr(item, 'originalname', item.name)}"
        if name in SLOW:
            item.add_marker(pytest.mark.slow)
            named.add(name)
    # a name that no longer names a test (renamed, moved) would quietly put a slow test in the fast tier
    collected = {item.path.stem for item in items}
    stale = sorted(n for n in SLOW - named if n.split("::")[0] in collected)
    chosen = config.option.keyword or config.option.markexpr or any("::" in arg for arg in config.args)
    if stale and not chosen:  # (a selection of tests leaves the rest of SLOW's uncollected)
        raise pytest.UsageError(f"tests/conftest.py SLOW names no test: {stale}")
