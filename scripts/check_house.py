#!/usr/bin/env python3
"""Checks the shape of the sources that a newcomer walks (issue 40):

  size     no source file of fs/ store/ gpu/ mount/ common/ over 900 lines;
  class    no class or struct with more than 40 member functions (declared in a header or
           in a .cc; constructors, destructor, operators and static members count, `= delete`d
           ones do not; a nested class counts on its own, as Outer::Inner);
  boundary no call of the publisher's internals from fs/ (`journal()`, `registry()`,
           `gate()`): fs/ asks Publication, which owns them;
  syscall  no backing-store syscall in fs/ (`::pread`, `::pwrite`, `posix_fadvise`,
           `copy_file_range`, `::open`) outside fs/transport/, which opens the FUSE device
           and its io_uring and passthrough controls; every backing-store syscall goes
           through store/'s BackingDir;
  docs     docs/bench/ holds current results only: every file there is named in docs/ (its
           benchmark's section of docs/BENCHMARKS.md) and no name carries a date; README.md
           stays under 150 lines and names no path outside the repository.

The class count reads the source as text (comments and literals removed, then the braces
of each class body followed); scripts/class_size.py counts the same with clang's own parse,
slower, from a build's compile_commands.json.

  scripts/check_house.py            print what breaks a rule; exit 1 if anything does
  scripts/check_house.py --classes  also print the ten largest classes
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ("fs/", "store/", "gpu/", "mount/", "common/")
EXTENSIONS = (".h", ".cc")
MAX_LINES = 900
MAX_METHODS = 40
BOUNDARY = re.compile(r"(\.|->)\s*(journal|registry|gate)\s*\(\s*\)")
SYSCALL = re.compile(r"::pread\b|::pwrite\b|\bposix_fadvise\b|\bcopy_file_range\b|::open\b")
SYSCALL_ALLOWED = ("fs/transport/",)
README_LINES = 150
DATED = re.compile(r"(19|20)\d\d[-_]?[01]\d[-_]?[0-3]\d")
OUTSIDE = re.compile(r"(^|[\s(`'\"])(\.\./|/work/|/home/)")


def sources():
    out = subprocess.run(["git", "-C", ROOT, "ls-files", "-co", "--exclude-standard", *DIRS],
                         check=True, capture_output=True, text=True).stdout.split("\n")
    for rel in sorted(out):
        if rel.endswith(EXTENSIONS) and os.path.isfile(os.path.join(ROOT, rel)):
            yield rel


def strip(text):
    """The text with comments, string and character literals and preprocessor lines blanked
    (newlines kept, so that offsets still map to lines)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i) or (c == "#" and (i == 0 or text[i - 1] == "\n")):
            j = text.find("\n", i)
            while c == "#" and j > 0 and text[j - 1] == "\\":  # a continued directive
                j = text.find("\n", j + 1)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i) and (i == 0 or not text[i - 1].isalnum()):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + (m.group(1) if m else "") + '"', i)
            j = n if end < 0 else end + len(m.group(1) if m else "") + 2
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:j]))
            i = j
        elif c in "\"'" and not (c == "'" and i > 0 and text[i - 1].isalnum()):
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (min(j, n) - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


CLASS_HEAD = re.compile(r"\b(class|struct)\s+(?:alignas\s*\([^)]*\)\s*)?(\w+)\s*(final\s*)?"
                        r"(:[^;{}()]*)?\{")
FUNCTION = re.compile(r"(~?\b\w+|\boperator\s*(?:\(\s*\)|[^\s(]+))\s*\(")
NOT_A_FUNCTION = {"alignas", "decltype", "sizeof", "alignof", "noexcept", "static_assert",
                  "requires", "void", "int", "bool", "char", "auto"}


def is_function(head):
    """Whether a member declaration (its text up to its body or ';') declares a function."""
    head = re.sub(r"\b(public|private|protected)\s*:", " ", head).strip()
    if not head or re.match(r"(using|typedef|friend|static_assert|enum|class|struct|union)\b",
                            head):
        return False
    head = re.sub(r"^template\s*<", "<", head)
    depth, i = 0, 0
    while i < len(head):
        c = head[i]
        m = FUNCTION.match(head, i) if depth == 0 and (i == 0 or not head[i - 1].isalnum()
                                                       and head[i - 1] != "_") else None
        if m:
            name = m.group(1)
            if name.startswith("operator"):
                return not re.search(r"=\s*delete\b", head)
            rest = head[m.end():].lstrip()
            if name.isupper() or name in NOT_A_FUNCTION or rest.startswith(("*", "&")):
                i = m.end() - 1  # a macro (GUARDED_BY) or a function pointer: go past it
            else:
                return not re.search(r"=\s*delete\b", head)
        if c == "<":
            depth += 1
        elif c == ">" and depth > 0:
            depth -= 1
        elif c in "={;" and depth == 0:
            return False
        elif c == "(":
            i = matching(head, i, "(", ")")
        i += 1
    return False


def matching(text, i, open_, close):
    """The offset of the bracket that closes the one at `i` (or the end)."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def count_class(text, start, end, name, out, where):
    """Counts the member functions in text[start:end], a class body; nested classes go to
    `out` on their own."""
    count, head_start, i = 0, start, start
    while i < end:
        c = text[i]
        if c == ";":
            if is_function(text[head_start:i]):
                count += 1
            head_start = i + 1
        elif c == "(":
            i = matching(text, i, "(", ")")
        elif c == "{":
            close = matching(text, i, "{", "}")
            head = text[head_start:i]
            nested = CLASS_HEAD.search(text, head_start, close + 1)
            if nested and nested.end() - 1 == i and not is_function(head):
                count_class(text, i + 1, close, name + "::" + nested.group(2), out, where)
            elif is_function(head):
                count += 1
                # A constructor's member initializers hold braces too: the body is the block
                # that no ',' or '{' follows.
                while True:
                    after = text[close + 1:end].lstrip()
                    if not after.startswith((",", "{")) or re.match(r"\{", after) is None and \
                            not after.startswith(","):
                        break
                    nxt = text.find("{", close + 1, end)
                    if nxt < 0:
                        break
                    close = matching(text, nxt, "{", "}")
                head_start = close + 1
            i = close
        i += 1
    out.append((count, name, where))


def classes(rel, text):
    """(methods, name, file:line) of every class and struct defined in `text`."""
    out = []
    pos = 0
    while True:
        m = CLASS_HEAD.search(text, pos)
        if not m:
            break
        open_ = m.end() - 1
        close = matching(text, open_, "{", "}")
        where = "%s:%d" % (rel, text.count("\n", 0, m.start()) + 1)
        count_class(text, open_ + 1, close, m.group(2), out, where)
        pos = close + 1
    return out


def check_docs():
    problems = []
    bench = os.path.join(ROOT, "docs", "bench")
    docs = ""
    for name in sorted(os.listdir(os.path.join(ROOT, "docs"))):
        if name.endswith(".md"):
            with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as f:
                docs += f.read()
    for name in sorted(os.listdir(bench)) if os.path.isdir(bench) else []:
        stem = name.rsplit(".", 1)[0]
        if DATED.search(name):
            problems.append("docs: docs/bench/%s is dated; keep the current result under the "
                            "benchmark's name (the history is in git)" % name)
        if name not in docs and stem + ".{" not in docs:
            problems.append("docs: docs/bench/%s is named nowhere in docs/" % name)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read().split("\n")
    if len(readme) > README_LINES:
        problems.append("docs: README.md has %d lines (at most %d)" % (len(readme), README_LINES))
    for i, line in enumerate(readme, 1):
        if OUTSIDE.search(line):
            problems.append("docs: README.md:%d names a path outside the repository" % i)
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", action="store_true", help="print the ten largest classes")
    args = parser.parse_args()
    problems, all_classes = [], []
    for rel in sources():
        with open(os.path.join(ROOT, rel), encoding="utf-8", errors="surrogateescape") as f:
            raw = f.read()
        lines = raw.count("\n") + (0 if raw.endswith("\n") else 1)
        if lines > MAX_LINES:
            problems.append("size: %s has %d lines (at most %d)" % (rel, lines, MAX_LINES))
        text = strip(raw)
        for methods, name, where in classes(rel, text):
            all_classes.append((methods, name, where))
            if methods > MAX_METHODS:
                problems.append("class: %s (%s) has %d member functions (at most %d)" %
                                (name, where, methods, MAX_METHODS))
        if rel.startswith("fs/"):
            for m in BOUNDARY.finditer(text):
                problems.append("boundary: %s:%d calls %s; ask Publication instead" %
                                (rel, text.count("\n", 0, m.start()) + 1, m.group(0).strip(".->")))
            if not rel.startswith(SYSCALL_ALLOWED):
                for m in SYSCALL.finditer(text):
                    problems.append("syscall: %s:%d calls %s; go through store/ (BackingDir)" %
                                    (rel, text.count("\n", 0, m.start()) + 1, m.group(0)))
    problems += check_docs()
    if args.classes:
        for methods, name, where in sorted(all_classes, reverse=True)[:10]:
            print("%4d  %s  (%s)" % (methods, name, where))
    for p in problems:
        print(p)
    if problems:
        print("check_house: %d problem(s)" % len(problems))
        return 1
    print("check_house: sizes, classes, fs/'s boundary and docs/bench are in order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
