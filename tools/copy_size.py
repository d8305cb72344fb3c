"""How many lines a copy changes: its diff against the parent script once the copier's deletions are made.

    python tools/copy_size.py docs/copying/text_classifier.py 03_ddp_launch.py
    python tools/copy_size.py MY_COPY.py 06_fault_tolerant.py --diff   # and the changed lines, where they are

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


def hunks(parent_lines, copy_lines):
    """diff -U0's hunks: (its header with the 1-based line numbers, its - and + lines). difflib without autojunk:
    it would take frequent lines, blank ones, for junk and report more changes than diff."""
    matcher = difflib.SequenceMatcher(None, parent_lines, copy_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            # as diff numbers them: an empty side by the line before it
            yield (f"@@ -{i1 + (i2 > i1)},{i2 - i1} +{j1 + (j2 > j1)},{j2 - j1} @@",
                   [f"-{line}" for line in parent_lines[i1:i2]] + [f"+{line}" for line in copy_lines[j1:j2]])


def copy_hunks(copy, parent):
    return list(hunks(without_measurement(Path(parent).read_text()), Path(copy).read_text().splitlines()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("copy", type=Path)
    p.add_argument("parent", type=Path)
    p.add_argument("--diff", action="store_true", help="print the changed lines too")
    args = p.parse_args(argv)
    for path in (args.copy, args.parent):
        if not path.is_file():
            sys.exit(f"error: {path}: no such file")
    found = copy_hunks(args.copy, args.parent)
    if args.diff:  # the parent's numbers are those of its lines once the measurement is deleted
        print("\n".join(line for header, changes in found for line in [header, *changes]))
    lines = [line for _, changes in found for line in changes]
    print(f"{args.copy.name}: {len(lines)} changed lines against {args.parent.name} without its measurement "
          f"({sum(line[0] == '-' for line in lines)} -, {sum(line[0] == '+' for line in lines)} +)")


if __name__ == "__main__":
    main()
