#!/usr/bin/env python3
"""Sums the reports of several soak runs (scripts/soak.py --out DIR), per mode and node count.

The long soak's counts (issue 41: 1,000 daemon kills across both modes, 1,000 saves with
rotation) come from several runs, one seed each; this adds up their soak.json files so the
figures a closing note or docs/RELIABILITY.md quotes are computed, not added by hand.

    scripts/soak_totals.py /tmp/soak-5601 /tmp/soak-5602 ...   # report dirs or soak.json files
    scripts/soak_totals.py --json /tmp/soak-56*                 # the same, as JSON

Prints a table (daemon kills, peer kills, trainer saves, re-saves, torn saves by a killed
rank, faults injected, operator aborts, verified loads, longest time down after a kill,
failures) and the seeds behind each column. Exits 1 if any run failed or ended early (a
run's report without `ok`), 2 on a missing or unreadable report.
"""
import argparse
import json
import os
import sys

# (column title, how to get it from one run's report); summed, except the maximum.
FIELDS = [
    ("daemon SIGKILLs", lambda r: r["counts"].get("daemon_kills", 0)),
    ("  of them the peer's", lambda r: r["counts"].get("peer_kills", 0)),
    ("trainer saves with rotation", lambda r: r["counts"].get("saves_train", 0)),
    ("re-saves (same dir, made again)",
     lambda r: r["counts"].get("saves_resave", 0) + r["counts"].get("saves_recreate", 0)),
    ("saves torn by a killed rank", lambda r: r["counts"].get("torn_rank_kills", 0)),
    ("  of them whole: the kill came after the save returned",
     lambda r: r["counts"].get("torn_committed", 0)),
    ("torch 2.x dcp.async_saves (sid root)", lambda r: r["counts"].get("saves_async2", 0)),
    ("  their last checkpoint loaded exactly from the backing store",
     lambda r: r["counts"].get("async2_verified", 0)),
    ("faults injected", lambda r: r["counts"].get("faults_injected", 0)),
    ("operator aborts", lambda r: r["counts"].get("operator_aborts", 0)),
    ("checkpoints verified from the backing store", lambda r: r.get("checkpoints_verified", 0)),
    ("publications checked for twice", lambda r: r["counts"].get("double_publish_checked", 0)),
    ("failures", lambda r: len(r.get("failures") or [])),
]
MAX_FIELDS = [("longest time down after a kill, s", lambda r: r.get("down_s_max", 0.0))]


def load(path):
    """The soak.json at `path` (a file or a report dir)."""
    if os.path.isdir(path):
        path = os.path.join(path, "soak.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"soak_totals: {path}: {e}", file=sys.stderr)
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="soak report dirs or soak.json files")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()

    columns = {}  # (mode, nodes) -> {"seeds": [...], title: value}
    not_ok = []
    for path in args.reports:
        report = load(path)
        if report is None:
            return 2
        if not report.get("ok"):
            not_ok.append(f"seed {report.get('seed')} ({path})")
        for run in report.get("runs", []):
            col = columns.setdefault((run["mode"], run["nodes"]), {"seeds": []})
            col["seeds"].append(run.get("seed", report.get("seed")))
            col["minutes"] = col.get("minutes", 0.0) + run.get("seconds", 0) / 60
            for title, get in FIELDS:
                col[title] = col.get(title, 0) + get(run)
            for title, get in MAX_FIELDS:
                col[title] = max(col.get(title, 0.0), get(run))
    keys = sorted(columns, key=lambda k: (k[1], k[0]))
    total = {title: sum(columns[k][title] for k in keys) for title, _ in FIELDS}
    total["minutes"] = sum(columns[k]["minutes"] for k in keys)

    if args.json:
        print(json.dumps({"columns": [dict(mode=k[0], nodes=k[1], **columns[k]) for k in keys],
                          "total": total, "not_ok": not_ok}, indent=1))
    else:
        names = [f"{m}, {n} node{'s' if n > 1 else ''}" for m, n in keys] + ["all"]
        rows = [("minutes of soak", [f"{columns[k]['minutes']:.0f}" for k in keys]
                 + [f"{total['minutes']:.0f}"])]
        for title, _ in FIELDS:
            rows.append((title, [f"{columns[k][title]:,}" for k in keys] + [f"{total[title]:,}"]))
        for title, _ in MAX_FIELDS:
            rows.append((title, [f"{columns[k][title]:.2f}" for k in keys]
                         + [f"{max(columns[k][title] for k in keys):.2f}" if keys else "-"]))
        print("| | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 1) + "|")
        for title, values in rows:
            print(f"| {title} | " + " | ".join(values) + " |")
        seeds = sorted({s for k in keys for s in columns[k]["seeds"]})
        print(f"\n{len(args.reports)} reports, seeds {', '.join(map(str, seeds))}")
        for line in not_ok:
            print(f"NOT OK: {line}")
    return 1 if not_ok or total["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
