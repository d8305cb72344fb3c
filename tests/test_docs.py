"""What the README teaches is kept true: its diffs are current, the scripts share their common parts word for
word, and the pitfalls it describes are real. (The SLURM batch script is run by a real scheduler: test_slurm.py.)"""
import ast
import subprocess
import sys

from torch.utils.data import DistributedSampler

from conftest import ROOT, SCRIPTS, TEST_IMAGES

# The model, the data pipeline and the evaluation (the DDP scripts' train_epoch also resumes from snapshots).
SHARED = ["Net", "fail", "load_mnist", "batches", "synchronize", "reset_peak_memory", "peak_memory_bytes",
          "write_json_atomically"]


def definitions(script):
    source = (ROOT / script).read_text()
    return {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def test_the_scripts_share_model_data_pipeline_and_evaluation_word_for_word():
    reference = definitions(SCRIPTS[0])
    for script in SCRIPTS[1:]:
        mine = definitions(script)
        for name in SHARED:
            assert mine.get(name) == reference[name], f"{script}: {name} differs from {SCRIPTS[0]}'s"


def test_readme_diffs_and_html_views_are_current():
    result = subprocess.run([sys.executable, "tools/script_diffs.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_stale_diff_is_caught(tmp_path):
    for name in [*SCRIPTS, "README.md"]:
        (tmp_path / name).write_text((ROOT / name).read_text())
    subprocess.run([sys.executable, ROOT / "tools/script_diffs.py", "--root", tmp_path], check=True, timeout=60)
    with open(tmp_path / "04_ddp_spawn.py", "a") as f:
        f.write("# an edit the README has not seen\n")
    result = subprocess.run([sys.executable, ROOT / "tools/script_diffs.py", "--root", tmp_path, "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "README.md" in result.stderr


def test_pitfall_distributed_sampler_pads_the_test_set():
    """Why the scripts shard the test set themselves: DistributedSampler repeats images to even out the shards."""
    counted = sum(len(DistributedSampler(range(TEST_IMAGES), num_replicas=3, rank=r, shuffle=False)) for r in range(3))
    assert counted == TEST_IMAGES + 2
