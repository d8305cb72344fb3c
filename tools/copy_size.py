"""How many lines a copy changes: its diff against the parent script once the copier's deletions are made.

    python tools/copy_size.py docs/copying/text_classifier.py 03_ddp_launch.py
    python tools/copy_size.py MY_COPY.py 06_fault_tolerant.py --diff   # and the changed lines themselves

The parent loses what docs/copying.md says a copier may delete: the measurement block (from the line
`# ---- Measurement` down to, not including, `if __name__`) and every line marked `# measure`. The count is
that of `diff -U0`: the + and - lines, without the two file headers (a changed line counts twice).
"""
import argparse
import difflib
import re
import sys
from pathlib import Path

MARKED = re.compile(r"#\s*measure\b")


def without_measurement(text):
    """The script's lines less the measurement block and the lines marked `# measure`."""
    lines, kept, block = text.splitlines(), [], False
    for line in lines:
        if line.startswith("# ---- Measurement"):
            block = True
        elif line.startswith("if __name__"):
            block = False
        if not block and not MARKED.search(line):
            kept.append(line)
    return kept


def changed(parent_lines, copy_lines):
    """The - and + lines of diff -U0 (difflib without autojunk: it would take frequent lines, blank ones, for
    junk and report more changes than diff)."""
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, parent_lines, copy_lines, autojunk=False).get_opcodes():
        if tag != "equal":
            out += [f"-{line}" for line in parent_lines[i1:i2]] + [f"+{line}" for line in copy_lines[j1:j2]]
    return out


def copy_size(copy, parent):
    return changed(without_measurement(Path(parent).read_text()), Path(copy).read_text().splitlines())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("copy", type=Path)
    p.add_argument("parent", type=Path)
    p.add_argument("--diff", action="store_true", help="print the changed lines too")
    args = p.parse_args(argv)
    for path in (args.copy, args.parent):
        if not path.is_file():
            sys.exit(f"error: {path}: no such file")
    lines = copy_size(args.copy, args.parent)
    if args.diff:
        print("\n".join(lines))
    print(f"{args.copy.name}: {len(lines)} changed lines against {args.parent.name} without its measurement "
          f"({sum(line[0] == '-' for line in lines)} -, {sum(line[0] == '+' for line in lines)} +)")


if __name__ == "__main__":
    main()
