"""Every measured figure in the README is a committed result's: each is computed here from the file under
results/ that holds it and must appear in the README as written, so a new result without new sentences fails;
and every figure the README gives (samples/s, x, %, MB, ms, s, min) lies in one of those sentences or in one
whose source is named (a paper, PyTorch's defaults, arithmetic), so a figure cannot enter unaccounted for."""
import csv
import inspect
import json
import re
from statistics import mean

import pytest

from helpers import MODES, ROOT, SCRIPTS, load_script

RESULTS = ROOT / "results"
CPU, H200, PIPELINE = RESULTS / "cpu-2core-amd-epyc", RESULTS / "1x-nvidia-h200-gpu-check", RESULTS / "cpu-pipeline"
FIRST_RUN = RESULTS / "first-run"
MODEL_PARALLEL = RESULTS / "cpu-2core-amd-epyc-model-parallel"  # 01, 09, 10 and 11, one epoch
FSDP_BIG = RESULTS / "cpu-2core-amd-epyc-fsdp-big"  # 08 and 12, one epoch; 12 in bf16 by hand
ANATOMY = RESULTS / "cpu-2core-amd-epyc-anatomy" / "anatomy"  # run_all.py --anatomy: each mode's step
STEP_PEAK = RESULTS / "cpu-2core-amd-epyc-step-peak"  # bench/anatomy.py for 03 and 08: each rank's step peak

# Figures the README takes from elsewhere, each with its source in the sentence, or that are definitions and
# arithmetic rather than measurements.
ELSEWHERE = [
    "buckets of about 25 MB",  # DDP's bucket_cap_mb default
    "downloads MNIST (12 MB)",  # the four files' size
    "(188 MB of training images)",  # 60,000 x 28 x 28 float32
    "30 minutes with gloo, 10 with NCCL",  # PyTorch's default timeouts
    "25 Gbit/s RoCE, RDMA over Ethernet): 90% for Inception V3 and ResNet-101, 68% for VGG-16",  # Horovod's benchmarks page
    "100% means n GPUs do n times the work of one",  # the definition of E(n)
    "600 s by default",  # torchrun's join timeout (test_readme_claims.py reads it from torch)
    "stage 0 does 90% of the multiply-adds",  # conv1 0.19 M, conv2 10.6 M of 12.0 M an image (fc1 1.18 M)
]


def rows(path):
    with open(path, newline="") as f:
        return {(row["mode"], int(row["n"])): row for row in csv.DictReader(f)}


def record(path):
    return json.loads(path.read_text())


def one_decimal_mb(n_bytes):
    return f"{n_bytes / 1e6:.1f} MB"


def first_run_block(script):
    """A first run as the README shows it: the script's own lines of its log, not torchrun's warnings."""
    return [line for line in (FIRST_RUN / f"{script}.log").read_text().splitlines() if not line.startswith("W1")]


def spread(script):
    """The slowest and the fastest of a first run's three tries (results/first-run/ABOUT.md), as "609-764"."""
    logs = [FIRST_RUN / f"{script}{tail}.log" for tail in ("", "-2", "-3")]
    speeds = [int(re.search(r": (\d+) samples/s", log.read_text())[1]) for log in logs]
    return f"{min(speeds)}-{max(speeds)}"


FIRST_RUNS = ["01_single_gpu", "03_ddp_launch"]


def measured(cpu_dir=CPU):
    """The README's wording of each measured figure, with the committed numbers put in."""
    cpu = {key: float(row["samples_per_s"]) for key, row in rows(cpu_dir / "summary.csv").items()}
    single, fsdp, ddp = cpu["single", 1], cpu["fsdp", 2], cpu["ddp_launch", 2]
    pairs = [v for (mode, n), v in cpu.items() if n == 2 and mode != "fsdp"]  # the DDP modes of two processes
    ratios = [v / single for v in pairs]
    records = {path.stem: record(path) for path in sorted((cpu_dir / "metrics").glob("*.json"))}
    fsdp_record = records["fsdp-n2-b64-r1"]
    target_epoch = max(next(i for i, e in enumerate(r["epochs_detail"], 1) if e["test_accuracy"] >= 0.98)
                       for r in records.values())
    numbers = sorted(MODES[mode].script[:2] for mode, _ in cpu)
    epoch_images = {r["train_samples"] // r["epochs"] for r in records.values()}
    epochs = {r["epochs"] for r in records.values()}
    assert len(epoch_images) == len(epochs) == 1, (epoch_images, epochs)  # every run, the same epochs
    duration = re.search(r"UTC \((\d+ min \d+ s)\)", (cpu_dir / "ABOUT.md").read_text())[1]
    gpu = {key: float(row["samples_per_s"]) for key, row in rows(H200 / "summary.csv").items()}
    gpu_01 = [gpu["single", 1]] + [record(H200 / p)["samples_per_s"] for p in
                                   ("gpu-check/01_single_gpu.py.json", "followup/01_fp32.json")]
    same_work = [v for (mode, n), v in gpu.items() if n == 1]
    fp32, amp = (record(H200 / "followup" / f"01_{name}.json")["samples_per_s"] for name in ("fp32", "amp"))
    cpu_fp32, cpu_amp = ([record(PIPELINE / f"{name}-{i}.json")["samples_per_s"] for i in (1, 2)]
                         for name in ("fp32", "amp"))
    e8 = record(RESULTS / "scaling-prediction" / "e8-gpus.json")  # a prediction, from bench/measure/scaling.py
    graph, compiled = step_forms()
    steps = {row["number"]: row for row in record(ANATOMY.parent / "env.json")["anatomy"]}
    weights = {name: p.numel() for name, p in load_script().Net().named_parameters()}
    fc1 = (weights["fc1.weight"] + weights["fc1.bias"]) / sum(weights.values())
    stages = record(MODEL_PARALLEL / "metrics" / "pipeline_parallel-n2-b64-r1.json")["epochs_detail"][-1]
    stage_1 = stages["bytes_per_rank"][1] / sum(stages["bytes_per_rank"])
    return anatomy_cells() + [
        f"a step allocated up to {step_peak('08')} MB above what an 08 rank held, {step_peak('03')} MB on 03's",
        f"compute {steps['08']['compute_ms']:.1f} ms a step against 03's {steps['03']['compute_ms']:.1f}",
        f"its weights and gradients are whole on every rank: {fc1:.0%} of the model",
        f"{steps['08']['exposed_comm_ms']:.1f} ms of collectives exposed, where 03's "
        f"{steps['03']['overlapped_comm_ms']:.1f} ms all overlapped",
        f"stage 1 holds {stage_1:.0%} of the weights",
        f"three runs each, one after another: 01's 200 steps at {spread('01_single_gpu')} samples/s, 03's 100 at "
        f"{spread('03_ddp_launch')}",
        f"one H200 trained 01 at {min(gpu_01) / 1000:.0f},000-{max(gpu_01) / 1000:.0f},000 samples/s",
        f"({fsdp:.0f} against {ddp:.0f} samples/s, {fsdp / ddp:.2f}x 03's, at n = 2 on the CPU)",
        f"{one_decimal_mb(fsdp_record['bytes_per_rank'][0])} per rank at n = 2 of the "
        f"{one_decimal_mb(fsdp_record['full_copy_bytes'])}",
        f"did {min(ratios):.2f}-{max(ratios):.2f}x 01's samples/s, 08 {fsdp / single:.2f}x",
        f"On real MNIST, quiet: 01 {single:.0f} samples/s; DDP's two processes {min(pairs):.0f}-{max(pairs):.0f} "
        f"(08 {fsdp:.0f})",
        f"{numbers[0]}-{numbers[-1]} each reached 98% by the {['1st', '2nd', '3rd'][target_epoch - 1]} of "
        f"{epochs.pop()} epochs of {epoch_images.pop():,} images (one run each, {duration} in all",
        f"for 8 GPUs: DDP's E(8) at most {e8['e_n']['ddp_launch']['8']:.2f}, FSDP2's at most "
        f"{e8['e_n']['fsdp']['8']:.2f}, from 01's {e8['step_ms']:.2f} ms step on one H200 and links of "
        f"{e8['busbw_gb_s']:.0f} GB/s",
        f"As one CUDA graph, 01's step ran {min(graph):.1f}-{max(graph):.1f}x as fast as eager, compiled "
        f"{min(compiled):.2f}-{max(compiled):.2f}x, in {len(graph)} runs (torch 2.11",
        f"on the H200 modes of the same work differed by up to {(max(same_work) / min(same_work) - 1) * 100:.0f}%",
        f"`--amp` ran at {amp / fp32:.2f}x of fp32 on the H200, one run on torch 2.11. On the CPU: "
        f"{mean(cpu_amp) / mean(cpu_fp32):.2f}x, two runs on torch 2.14",
    ]


def step_forms():
    """01's step as one CUDA graph and compiled, each against eager: every table of the GPU check's logs of
    2026-12-04 (bench/measure/step_forms.py prints one a run), and its step-forms.json."""
    day = H200 / "2026-12-04"
    factors = {"graph": [], "compile": []}
    for log in sorted(day.glob("try*.log")):
        for form, factor in re.findall(r"^(graph|compile)\s+[\d,]+\s+([\d.]+)x", log.read_text(), re.M):
            factors[form].append(float(factor))
    forms = record(day / "step-forms.json")
    assert forms["torch_version"].startswith("2.11"), forms["torch_version"]
    for form, factor in factors.items():
        factor.append(forms["forms"][form]["samples_per_s"] / forms["forms"]["eager"]["samples_per_s"])
    return factors["graph"], factors["compile"]


def step_peak(number):
    """The highest of the ranks' step peaks, in MB: it is the one that must fit."""
    return f"{max(r['step_peak_bytes'] for r in record(STEP_PEAK / number / 'anatomy.json')['per_rank']) / 1e6:.1f}"


def handed_in(number):
    """{collective: MB} that rank 0 hands in, in the committed anatomy's first profiled step."""
    moved = record(ANATOMY / number / "anatomy.json")["per_rank"][0]["steps"][0]["collectives"]
    return {name: f"{c['in_bytes'] / 1e6:.2f} MB" for name, c in moved.items()}


def anatomy_cells():
    """The README's column "measured with --anatomy": what a rank hands in per step."""
    ddp, fsdp, tp, pp, mesh = (handed_in(n) for n in ("03", "08", "09", "10", "11"))
    received = record(ANATOMY / "10" / "anatomy.json")["per_rank"][0]["steps"][0]["collectives"]["recv"]
    return [f"| {ddp['all_reduce']} to all-reduces |",
            f"| {fsdp['all_gather']} to all-gathers, {fsdp['all_reduce']} to all-reduces: gloo's reduce-scatter |",
            f"| {tp['all_reduce']} to all-reduces |",
            f"| {pp['send']} sent, {received['out_bytes'] / 1e6:.2f} MB received |",
            f"| at n = 4: {mesh['all_gather']} to all-gathers, {mesh['all_reduce']} to all-reduces |"]


def readme_text():
    return " ".join((ROOT / "README.md").read_text().split())  # sentences across line breaks


def test_the_readme_quotes_the_committed_results():
    readme = readme_text()
    missing = [sentence for sentence in measured() if sentence not in readme]
    assert not missing, f"the README does not say what results/ measured: {missing}"


@pytest.mark.parametrize("script", FIRST_RUNS)
def test_the_output_the_readme_shows_is_the_committed_log(script):
    readme = (ROOT / "README.md").read_text()
    assert "\n".join(first_run_block(script)) in readme, f"README's {script} output is not results/first-run's log"


FIGURE = re.compile(r"(?<![\w/.-])\d[\d,.]*(?:-\d[\d,.]*)?(?:x\b|\s?(?:samples/s|MB|GB|ms|%|s\b|min\b|minutes|Gbit/s))")


def unaccounted(readme, sentences):
    """The figures of the README outside every given sentence."""
    covered = [range(m.start(), m.end()) for s in sentences for m in re.finditer(re.escape(s), readme)]
    return [m.group() for m in FIGURE.finditer(readme)
            if not any(m.start() in span and m.end() - 1 in span for span in covered)]


def accounted():
    return measured() + ELSEWHERE + [" ".join(first_run_block(script)) for script in FIRST_RUNS]


def test_every_figure_in_the_readme_is_measured_here_or_names_its_source():
    assert not unaccounted(readme_text(), accounted())


@pytest.mark.parametrize("change", ["the sweep", "a new figure"])
def test_a_changed_result_or_a_new_figure_fails_the_check(tmp_path, change):
    readme = readme_text()
    if change == "the sweep":
        (tmp_path / "metrics").mkdir()
        for path in (CPU / "metrics").glob("*.json"):
            (tmp_path / "metrics" / path.name).write_text(path.read_text())
        (tmp_path / "ABOUT.md").write_text((CPU / "ABOUT.md").read_text())
        (tmp_path / "summary.csv").write_text((CPU / "summary.csv").read_text().replace("859.869", "700.0", 1))
        assert sum(sentence not in readme for sentence in measured(tmp_path)) == 2  # 01's samples/s in each
    else:
        assert unaccounted(readme + " 02 ran at 1,234 samples/s.", accounted()) == ["1,234 samples/s"]


def test_12_on_real_mnist_keeps_08s_accuracy_and_bf16_within_half_a_point():
    """One epoch of real MNIST at 2 x 64: 12's sharded snapshots change nothing it learns (within 0.3 points),
    and bf16 compute stays within 0.5 points of 08's fp32."""
    accuracy = {mode: float(row["test_accuracy"]) for (mode, _), row in rows(FSDP_BIG / "runs.csv").items()}
    bf16 = record(FSDP_BIG / "bf16" / "metrics.json")
    assert bf16["global_batch"] == 128 and bf16["train_samples"] == record(
        FSDP_BIG / "metrics" / "fsdp-n2-b64-r1.json")["train_samples"], "not the sweep's epoch"
    assert abs(accuracy["fsdp_big"] - accuracy["fsdp"]) <= 0.003, accuracy
    assert abs(bf16["test_accuracy"] - accuracy["fsdp"]) <= 0.005, (bf16["test_accuracy"], accuracy)


def test_results_readme_describes_the_data_path_the_scripts_have():
    """results/README.md says how a batch reaches the GPU; each script's MNIST.__getitems__ is what it says."""
    said = (ROOT / "results" / "README.md").read_text()
    assert "each\nbatch's row numbers copied there as one small index tensor, without waiting" in said
    for script in SCRIPTS:
        getitems = inspect.getsource(load_script(script).MNIST.__getitems__)
        assert "torch.tensor(rows).to(self.labels.device, non_blocking=True)" in getitems, script
