"""The README's figures from the committed CPU sweep are that sweep's: each is computed here from
results/cpu-2core-amd-epyc/summary.csv and must appear in the README as written, so a new sweep without new
sentences fails. (Figures from elsewhere name their source in the sentence.)"""
import csv

from helpers import ROOT

SWEEP = ROOT / "results" / "cpu-2core-amd-epyc" / "summary.csv"


def samples_per_s(sweep):
    with open(sweep, newline="") as f:
        return {(row["mode"], int(row["n"])): float(row["samples_per_s"]) for row in csv.DictReader(f)}


def expected_sentences(sweep=SWEEP):
    """The README's wording of each figure, with the sweep's numbers put in."""
    x = samples_per_s(sweep)
    single, fsdp, ddp = x["single", 1], x["fsdp", 2], x["ddp_launch", 2]
    pairs = [v for (mode, n), v in x.items() if n == 2 and mode != "fsdp"]  # the DDP modes of two processes
    ratios = [v / single for v in pairs]
    return [
        f"01 at {single:.0f} samples/s",
        f"On real MNIST, quiet: 01 {single:.0f} samples/s; DDP's two processes {min(pairs):.0f}-{max(pairs):.0f} "
        f"(08 {fsdp:.0f})",
        f"did {min(ratios):.2f}-{max(ratios):.2f}x 01's samples/s, 08 {fsdp / single:.2f}x",
        f"({fsdp:.0f} against {ddp:.0f} samples/s, {fsdp / ddp:.2f}x 03's, at n = 2 on the CPU)",
    ]


def test_the_readme_quotes_the_committed_sweep():
    readme = " ".join((ROOT / "README.md").read_text().split())  # sentences across line breaks
    missing = [sentence for sentence in expected_sentences() if sentence not in readme]
    assert not missing, f"the README does not say what {SWEEP.relative_to(ROOT)} measured: {missing}"


def test_a_changed_sweep_fails_the_check(tmp_path):
    changed = tmp_path / "summary.csv"
    changed.write_text(SWEEP.read_text().replace("859.8698655219388", "700.0", 1))  # 01's samples/s
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert sum(sentence not in readme for sentence in expected_sentences(changed)) == 3
