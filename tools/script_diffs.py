"""Keep the README's diffs between the numbered scripts, and their side-by-side HTML views, in step with the code.

    python tools/script_diffs.py            # rewrite the diffs in README.md and docs/diffs/*.html
    python tools/script_diffs.py --check    # exit 1, naming what is stale (the tests run this)

In README.md each diff lives between `<!-- diff A B -->` and `<!-- end diff -->`; everything else is left alone.
"""
import argparse
import difflib
import re
import sys
from pathlib import Path

PAIRS = [("01_single_gpu.py", "02_data_parallel.py"), ("01_single_gpu.py", "03_ddp_launch.py"),
         ("03_ddp_launch.py", "04_ddp_spawn.py"), ("04_ddp_spawn.py", "05_multinode_mnist.py"),
         ("03_ddp_launch.py", "06_fault_tolerant.py")]
BLOCK = re.compile(r"(<!-- diff (\S+) (\S+) -->\n).*?(<!-- end diff -->)", re.S)


def read_lines(root, name):
    return (root / name).read_text().splitlines()


def diff_block(root, a, b):
    """The unified diff of two scripts as a Markdown block, with its size in changed lines."""
    lines = list(difflib.unified_diff(read_lines(root, a), read_lines(root, b), a, b, n=1, lineterm=""))
    changed = sum(1 for line in lines[2:] if line[:1] in "+-")
    return f"{changed} changed lines (`diff -U1 {a} {b}`):\n\n```diff\n" + "\n".join(lines) + "\n```\n"


def html_name(a, b):
    return f"{a.removesuffix('.py')}--{b.removesuffix('.py')}.html"


def side_by_side(root, a, b):
    return difflib.HtmlDiff(wrapcolumn=100).make_file(read_lines(root, a), read_lines(root, b), a, b, context=True)


def expected_files(root):
    """{path: text} for README.md and every HTML view, as they should be now."""
    readme = root / "README.md"
    text = BLOCK.sub(lambda m: m.group(1) + diff_block(root, m.group(2), m.group(3)) + m.group(4), readme.read_text())
    files = {readme: text}
    files.update({root / "docs" / "diffs" / html_name(a, b): side_by_side(root, a, b) for a, b in PAIRS})
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is stale")
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent, help="repository root")
    args = p.parse_args(argv)
    files = expected_files(args.root)  # once: HtmlDiff numbers its anchors per call, so a second call differs
    stale = [path for path, text in files.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path.relative_to(args.root)} (run python tools/script_diffs.py)", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[path])
    print(f"updated {len(stale)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
