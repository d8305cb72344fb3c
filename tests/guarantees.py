"""The guarantees every numbered script shares, as one table over the family (bench/family.py's MODES).

A row a guarantee, a column a mode. Each cell is one of three:

- tested: the test that proves it for this mode, a test id as `pytest --collect-only -q` prints it;
- n/a: the guarantee has no meaning for this mode, and why;
- refused: the mode cannot do it, and the line its user sees.

Each cell comes from the mode's family row, never from its name. So a new row of MODES gets a cell in every
row at once, and tests/unit/test_guarantee_table.py checks that each tested cell's test exists.

    python tests/guarantees.py        # the table as Markdown, as tests/README.md shows it
"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from bench.family import MODES  # noqa: E402

TRAINERS = "tests/integration/test_trainers.py"
PLATFORMS = "tests/unit/test_platforms.py"
LIGHTNING = "tests/integration/test_lightning.py"
EACH_MODE = "tests/integration/test_each_mode_runs.py"


def tested(path, test, param):
    return ("tested", f"{path}::{test}[{param}]")


def same_update(mode):
    if mode.needs:  # 07: Lightning's own steps against 01's
        return ("tested", f"{LIGHTNING}::test_two_processes_take_01s_steps_at_twice_the_batch")
    return tested(TRAINERS, "test_same_global_batch_gives_the_same_update", mode.script)


def every_image_once(mode):
    if mode.needs:
        return ("tested", f"{LIGHTNING}::test_evaluation_counts_every_test_image_once_at_world_size_3")
    return tested(TRAINERS, "test_every_test_image_is_scored_once_and_the_saved_model_is_01s", mode.script)


def rank_0_writes(mode):
    if mode.needs:
        return ("tested", f"{LIGHTNING}::test_output_is_01s_without_lightnings_noise")
    return tested(TRAINERS, "test_only_rank_zero_prints_epoch_lines", mode.script)


def bounded_restart(mode):
    if mode.launch.torchrun:
        return tested("tests/integration/test_reliability.py",
                      "test_a_torchrun_restart_of_any_script_trains_to_the_end", mode.script)
    if not mode.collective:
        return ("n/a", "one process: nothing to restart")
    return ("n/a", f"started by {'Lightning' if mode.needs else 'mp.spawn'}, not torchrun: nothing restarts it")


def bad_input(mode):
    return tested("tests/unit/test_trainer_parts.py",
                  "test_an_epoch_is_only_full_batches_and_a_batch_larger_than_the_share_is_refused", mode.script)


def too_many_processes(mode):
    if mode.launch.torchrun:
        return tested(PLATFORMS, "test_more_processes_than_gpus_are_refused_in_one_line_before_the_process_group",
                      f"{mode.script}-cuda")
    if mode.launch.count_flag == "--nprocs" or mode.launch.nodes > 1:
        return tested(PLATFORMS, "test_spawning_scripts_refuse_more_processes_than_gpus_in_the_parent_before_any_"
                      "process", mode.script)
    if mode.needs:
        return tested(PLATFORMS, "test_07_counts_cuda_or_mps_gpus_and_refuses_more_devices_in_one_line", "cuda")
    if mode.batch.one_loader:
        return tested("tests/integration/test_bad_input.py", "test_bad_input_fails_with_one_clear_line",
                      "gpu id does not exist")
    return ("n/a", "one process")


def cpu_beside_a_gpu(mode):
    return tested("tests/integration/test_cpu_means_the_cpu.py",
                  "test_every_script_with_cpu_trains_on_the_cpu_beside_an_accelerator", f"{mode.script}-cuda")


def cudas_paths(mode):
    return tested(EACH_MODE, "test_each_mode_takes_cudas_default_paths_and_never_waits_at_a_step", mode.name)


def on_a_mac(mode):
    if mode.needs:  # 07: Lightning takes MPS itself
        mac = "tests/integration/test_on_a_mac.py"
        return ("tested", f"{mac}::test_07_trains_on_mps_through_each_epochs_end_in_float32")
    if mode.launch.group:  # a process group: no backend takes MPS tensors, so the ranks train on the CPU
        return tested(PLATFORMS, "test_ddp_on_mps_trains_on_the_cpu_with_gloo_and_says_so_in_one_line", mode.script)
    if mode.batch.one_loader:
        return ("refused", "DataParallel needs CUDA: training one replica on mps")
    return tested(PLATFORMS, "test_01_trains_on_the_accelerator_there_is_and_on_the_cpu_with_cpu", "mps")


def on_windows(mode):
    if mode.needs:  # 07: Lightning's strategy is told the backend
        return tested(PLATFORMS, "test_07_without_nccl_as_on_windows_asks_lightning_for_gloo", "ddp-popen")
    if mode.launch.group:
        return tested(PLATFORMS, "test_ddp_on_cuda_without_nccl_as_on_windows_takes_gloo_on_the_gpu", mode.script)
    return ("n/a", "no process group: nothing that Windows lacks")


def harness_row(mode):
    return tested(EACH_MODE, "test_each_mode_trains_and_writes_its_record", mode.name)


GUARANTEES = [
    ("the same update as 01 at the same global batch", same_update),
    ("every test image scored once; the saved model is 01's", every_image_once),
    ("only rank 0 prints and writes", rank_0_writes),
    ("a restart by torchrun trains to the end", bounded_restart),
    ("a batch larger than the data: one line", bad_input),
    ("more processes than GPUs: one line, before any starts", too_many_processes),
    ("`--cpu` on a GPU machine trains on the CPU", cpu_beside_a_gpu),
    ("CUDA's default paths, forced on the CPU", cudas_paths),
    ("a Mac (MPS stand-in)", on_a_mac),
    ("Windows (no NCCL)", on_windows),
    ("the harness runs it and reads its record", harness_row),
]


def cells():
    """{(guarantee, mode name): (kind, what)} for every guarantee and every mode of the family."""
    return {(words, name): cell(mode) for words, cell in GUARANTEES for name, mode in MODES.items()}


def markdown():
    marks = {"tested": "tested", "n/a": "n/a", "refused": "refused"}
    head = "| guarantee | " + " | ".join(mode.number for mode in MODES.values()) + " |"
    lines = [head, "|" + " --- |" * (len(MODES) + 1)]
    table = cells()
    for words, _ in GUARANTEES:
        lines.append(f"| {words} | " + " | ".join(marks[table[words, name][0]] for name in MODES) + " |")
    notes = sorted({f"- {MODES[name].number}, {words}: {kind}, {what}." for (words, name), (kind, what)
                    in table.items() if kind != "tested"})
    return "\n".join(lines) + "\n\nWhere a cell is not tested:\n\n" + "\n".join(notes) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
