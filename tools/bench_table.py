"""Merges kerf's benchmark JSON with the reference JSON into one Markdown table.

    python3 tools/bench_table.py kerf.json reference.json > table.md

Each cell: median microseconds and the achieved bandwidth as a percentage of a
same-size device-to-device copy measured in the same run. Each benchmark
measures that copy itself; a row divides all of its cells by the fastest copy
any of them measured, so that one slow copy measurement cannot flatter one
column (a reference run once timed the 64 MB copy at 1.5 TB/s instead of 2.5).
"""
import json
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"results": []}


def main():
    data = [load(p) for p in sys.argv[1:]]
    rows = {}
    impls = []
    device = next((d.get("device") for d in data if d.get("device")), "unknown device")
    for d in data:
        for r in d["results"]:
            key = (r["op"], r["shape"])
            rows.setdefault(key, {})[r["impl"]] = r
            if r["impl"] not in impls:
                impls.append(r["impl"])
    print(f"device: {device}\n")
    head = "| op | shape | " + " | ".join(f"{i} (us, % of copy)" for i in impls) + " |"
    print(head)
    print("|" + "---|" * (2 + len(impls)))
    for (op, shape), by_impl in rows.items():
        copies = [r["copy_gbps"] for r in by_impl.values() if r.get("copy_gbps")]
        copy = max(copies) if copies else None
        cells = []
        for i in impls:
            r = by_impl.get(i)
            if not r:
                cells.append("-")
                continue
            pct = 100.0 * r["gbps"] / copy if copy else float("nan")
            cells.append(f"{r['median_us']:.1f} us, {pct:.0f}%")
        print(f"| {op} | {shape} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
