#!/usr/bin/python3
"""Counts the member functions of every class in fs/, store/, common/ and mount/, and finds
.cc files that define methods of a class declared in another file's header beside their own.

Uses clang's own parse (clang++ -Xclang -ast-dump=json, filtered to ckptfs::), one
translation unit per .cc of those folders from build/compile_commands.json, plus any header
no .cc reaches. A method is a user-declared member function of the class (constructors,
destructor, operators and static members included; implicit and `= delete`d ones not;
nested classes counted on their own, as Outer::Inner).

An out-of-line definition in X.cc of a method of a class declared in Y.h is allowed when
Y is X (the same stem), when X is Y_<part> (one class's methods split along a seam, as
RocksDB's db_impl_write.cc beside db_impl.h: journal_stop.cc beside journal.h), and when
the class is declared in X.cc itself; anything else is listed under "foreign definitions".

Usage: scripts/class_size.py [--build DIR] [--over N] [--jobs N]
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRS = ("fs/", "store/", "common/", "mount/")
METHOD_KINDS = {"CXXMethodDecl", "CXXConstructorDecl", "CXXDestructorDecl",
                "CXXConversionDecl"}


def ours(path):
    p = os.path.relpath(os.path.normpath(os.path.join(ROOT, path)), ROOT)
    return p if p.startswith(DIRS) else None


def flags_for(command, source):
    args = shlex.split(command)[1:]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = True
            continue
        if a == source or a.startswith(("-O", "-g", "-W")) or a.endswith(".cc"):
            continue
        out.append(a)
    return out


class Walker:
    """Follows clang's JSON locations, which name a file only when it changes, through the
    tree in document order, and calls visit(node, file, record_name, in_record) for every
    node after its children (file: where the node's own location is)."""

    def __init__(self):
        self.file = None

    def loc(self, node):
        if not isinstance(node, dict):
            return
        for key in ("spellingLoc", "expansionLoc"):
            if key in node:
                self.loc(node[key])
        if "file" in node:
            self.file = node["file"]

    def walk(self, node, visit, outer="", in_record=False):
        start = None
        name = None
        is_record = node.get("kind") == "CXXRecordDecl" and node.get("name")
        if is_record:
            name = outer + node["name"]
        for key, value in node.items():
            if key == "loc":
                self.loc(value)
                start = self.file
            elif key == "range":
                self.loc(value.get("begin", {}))
                self.loc(value.get("end", {}))
            elif key == "inner":
                for child in value:
                    if is_record:
                        self.walk(child, visit, name + "::", True)
                    elif node.get("kind") in ("NamespaceDecl", "LinkageSpecDecl",
                                              "TranslationUnitDecl"):
                        self.walk(child, visit, outer, False)
                    else:
                        self.walk(child, visit, outer, in_record)
        visit(node, start, name, in_record)


def parse_tu(cmd):
    source, flags = cmd
    argv = ["clang++", "-fsyntax-only", "-Wno-everything", "-Xclang", "-ast-dump=json",
            "-Xclang", "-ast-dump-filter", "-Xclang", "ckptfs::"] + flags
    if source.endswith(".h"):
        argv += ["-x", "c++-header"]
    argv.append(source)
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    text, pos, roots = proc.stdout, 0, []
    dec = json.JSONDecoder()
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        obj, pos = dec.raw_decode(text, pos)
        roots.append(obj)
    records, defs = {}, []
    walker = Walker()

    def count_methods(rec):
        n = 0
        for child in rec.get("inner", []):
            kind = child.get("kind")
            if kind == "FunctionTemplateDecl":
                child = next((c for c in child.get("inner", []) if c.get("kind") in METHOD_KINDS),
                             None)
                kind = child.get("kind") if child else None
            if kind in METHOD_KINDS and not child.get("isImplicit") and \
                    not child.get("explicitlyDeleted"):
                n += 1
        return n

    def visit(node, file, record_name, in_record):
        kind = node.get("kind")
        if kind == "CXXRecordDecl" and record_name and node.get("completeDefinition") and \
                not node.get("isImplicit") and file and ours(file):
            records[node["id"]] = (record_name, ours(file), count_methods(node))
        elif kind in METHOD_KINDS and not in_record and "parentDeclContextId" in node and \
                any(c.get("kind") == "CompoundStmt" for c in node.get("inner", [])) and \
                file and ours(file):
            defs.append((ours(file), node["parentDeclContextId"], node.get("name")))

    for root in roots:
        walker.walk(root, visit)
    return source, records, defs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--over", type=int, default=40)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--all", action="store_true", help="print every class")
    ap.add_argument("--flags-root", default=None,
                    help="the source root the compile commands name, when they were made "
                         "for another checkout (its -I paths are pointed here)")
    opts = ap.parse_args()
    commands = json.load(open(os.path.join(opts.build, "compile_commands.json")))
    tus, flags = [], None
    for c in commands:
        rel = ours(c["file"].replace(opts.flags_root, ROOT) if opts.flags_root else c["file"])
        if rel and rel.endswith(".cc"):
            f = flags_for(c["command"], c["file"])
            if opts.flags_root:
                f = [a.replace(opts.flags_root, ROOT) for a in f]
            tus.append((rel, f))
            if rel.startswith("fs/"):
                flags = f  # the widest include set (fs links store and common)
    # Sources of these folders that the compile commands do not name (another checkout):
    # compiled with the fs/ flags.
    listed = {rel for rel, _ in tus}
    for d in DIRS:
        for dirpath, _, names in os.walk(os.path.join(ROOT, d)):
            for n in names:
                rel = os.path.relpath(os.path.join(dirpath, n), ROOT)
                if n.endswith(".cc") and rel not in listed and flags:
                    tus.append((rel, flags))
    tus = [(rel, f) for rel, f in tus if os.path.exists(os.path.join(ROOT, rel))]
    classes, defs = {}, []
    seen_files = set()

    def run(batch):
        with concurrent.futures.ThreadPoolExecutor(opts.jobs) as pool:
            for source, records, tu_defs in pool.map(parse_tu, batch):
                seen_files.add(source)
                for rid, (name, f, n) in records.items():
                    classes[(f, name)] = n
                    seen_files.add(f)
                for f, parent, method in tu_defs:
                    if parent in records:
                        name, decl, _ = records[parent]
                        defs.append((f, name, decl, method))
    run(tus)
    headers = []
    for d in DIRS:
        for dirpath, _, names in os.walk(os.path.join(ROOT, d)):
            for n in names:
                rel = os.path.relpath(os.path.join(dirpath, n), ROOT)
                if n.endswith(".h") and rel not in seen_files:
                    headers.append((rel, flags))
    run(headers)

    print(f"{'methods':>7}  class (declared in)")
    for (f, name), n in sorted(classes.items(), key=lambda kv: -kv[1]):
        if opts.all or n > opts.over:
            print(f"{n:>7}  {name} ({f})")
    foreign = set()
    for f, name, decl, method in defs:
        stem = lambda p: os.path.splitext(p)[0]
        part_of = stem(f).startswith(stem(decl) + "_")
        if stem(f) != stem(decl) and not part_of and f != decl:
            foreign.add((f, name, decl))
    print("\nforeign definitions (X.cc defines methods of a class declared in another header):")
    for f, name, decl in sorted(foreign):
        print(f"  {f}: {name} (declared in {decl})")
    if not foreign:
        print("  none")


if __name__ == "__main__":
    sys.exit(main())
