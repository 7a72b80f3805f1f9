#!/usr/bin/env python3
"""Checks that every include block of the C and C++ sources is in clang-format's order.

The order is .clang-format's (Google style: the file's own header first, then C system
headers, C++ headers, and the project's, each block sorted; blocks are kept as written).
Only the include lines are asked about: clang-format runs with --lines over each run of
`#include` lines, so the rest of a file's formatting is not judged here.

  scripts/check_includes.py          list the files whose includes are out of order; exit 1
  scripts/check_includes.py --fix    sort them in place

Exit 77 (a skip for ctest) when clang-format is not installed (scripts/setup.sh installs it).
"""
import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTENSIONS = (".h", ".cc", ".c", ".cpp", ".hpp")


def sources():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard"],
                         check=True, capture_output=True, text=True).stdout.split("\n")
    for rel in out:
        if rel.endswith(EXTENSIONS) and not rel.startswith("tests/fixtures/") and \
                os.path.isfile(os.path.join(ROOT, rel)):
            yield rel


def include_runs(path):
    """--lines=a:b for each run of consecutive #include lines (1-based, inclusive)."""
    runs, start = [], None
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("#include"):
            if start is None:
                start = i
        elif start is not None:
            runs.append(f"--lines={start}:{i - 1}")
            start = None
    if start is not None:
        runs.append(f"--lines={start}:{len(lines)}")
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fix", action="store_true", help="sort the includes in place")
    args = parser.parse_args()
    tool = shutil.which("clang-format") or shutil.which("clang-format-14")
    if tool is None:
        print("check_includes: clang-format is not installed (scripts/setup.sh); skipped")
        return 77
    bad = []
    for rel in sources():
        path = os.path.join(ROOT, rel)
        runs = include_runs(path)
        if not runs:
            continue
        cmd = [tool, "--style=file", *runs]
        if args.fix:
            subprocess.run([*cmd, "-i", path], check=True, cwd=ROOT)
            continue
        with open(path, "rb") as f:
            before = f.read()
        after = subprocess.run([*cmd, path], check=True, capture_output=True, cwd=ROOT).stdout
        if after != before:
            bad.append(rel)
    if bad:
        print(f"check_includes: {len(bad)} files have includes out of order "
              "(scripts/check_includes.py --fix sorts them):")
        for rel in bad:
            print(f"  {rel}")
        return 1
    if not args.fix:
        print("check_includes: every include block is in order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
