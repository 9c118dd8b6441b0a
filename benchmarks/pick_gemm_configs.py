"""Choose `tuning.GEMM_CONFIGS` and the smallest M worth the GEMM from a `sweep_gemm.py --json` file.

    python pick_gemm_configs.py sweep.json [--write ../kernels/tuning.py] [--prefetch 1]

Per swept M (one bucket each, the largest for any larger M): the configuration (its split-K the bucket's largest;
`gemm_config` may take fewer where the tiles fill the GPU; the rows of the `--prefetch` mode only) whose time, relative to the best configuration of each shape, has the smallest geometric mean over the shapes.
The smallest M printed is the smallest swept M from which on the GEMM with the rotation beats the op without the
GEMM on every shape at every larger swept M (`TURBOQUANT_GEMM_MIN_M`, `tuning.GEMM_MIN_M`).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys


def pick(rows: list[dict]) -> tuple[list[tuple[int, tuple]], int | None]:
    by_m: dict[int, dict] = {}
    for r in rows:
        bm, bn, _bk, split, swap, lanes, group, warps, stages = r["cfg"]
        key = (bm, bn, bool(swap), bool(lanes), group, warps, stages, split)
        cell = by_m.setdefault(r["m"], {}).setdefault(r["shape"], {})
        cell[key] = min(cell.get(key, math.inf), r["us"])
    table, wins = [], {}
    for m in sorted(by_m):
        shapes = by_m[m]
        keys = set.intersection(*(set(v) for v in shapes.values()))
        best = {s: min(v.values()) for s, v in shapes.items()}
        score = {k: sum(math.log(shapes[s][k] / best[s]) for s in shapes) / len(shapes) for k in keys}
        chosen = min(score, key=score.get)
        table.append((m, chosen))
        wins[m] = all(shapes[s][chosen] + _rot(rows, s, m) < _op(rows, s, m) for s in shapes)
    table[-1] = (1 << 62, table[-1][1])
    min_m = None
    for m in sorted(wins, reverse=True):
        if not wins[m]:
            break
        min_m = m
    return table, min_m


def _rot(rows, shape, m):
    return min(r["rot"] for r in rows if r["shape"] == shape and r["m"] == m)


def _op(rows, shape, m):
    return min(r["op"] for r in rows if r["shape"] == shape and r["m"] == m)


def render(table) -> str:
    lines = ["GEMM_CONFIGS = ("]
    for top, cfg in table:
        bound = "1 << 62" if top == 1 << 62 else str(top)
        lines.append(f"    ({bound}, {cfg!r}),")
    lines.append(")")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("sweep")
    p.add_argument("--write", default="")
    p.add_argument("--prefetch", type=int, default=1)
    args = p.parse_args()
    with open(args.sweep) as f:
        rows = [r for r in json.load(f) if int(r.get("prefetch", 0)) == args.prefetch]
    table, min_m = pick(rows)
    text = render(table)
    print(text)
    print(f"smallest M: {min_m}")
    if args.write:
        with open(args.write) as f:
            src = f.read()
        new, n = re.subn(r"GEMM_CONFIGS = \(\n(?:    .*\n)*\)", text, src)
        if n != 1:
            raise SystemExit(f"no GEMM_CONFIGS block in {args.write}")
        with open(args.write, "w") as f:
            f.write(new)
    if min_m is not None:
        print(f"MIN_M={min_m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
