"""Alternate ``fmha bench`` between builds, round by round, and print each cell's median per build.

    python benchmarks/ab.py --tree src --tree .scratch/branch/src --rounds 4 -- \\
        --direction fwd --head-dims 128 --seqlens 16384 --causal 0 --providers fmha --features plain window

Separate processes of one build differ by up to ±5 % on an H100 (benchmarks/NOTES.md, sessions
44-47), more than most changes are worth, so one run of each build decides nothing. Each round runs
``python -m fmha bench`` once per tree, each in a fresh process with ``PYTHONPATH`` at that tree, the
trees' order rotating from round to round (so a drift of the GPU does not favour one). Each cell
prints every tree's median, range and number of runs and its median over the first tree's. Peers in
``--providers`` are controls: the same library under every tree, so their ratios show the noise.
Each run starts in a scratch directory, so no ``fmha`` in the working directory shadows the trees;
the exit status is 1 if any run failed or timed out (the cells it finished still count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

def cell_name(record: dict) -> str:
    causal = "causal" if record["causal"] else "plain"
    feature = "" if record.get("feature", "plain") == "plain" else f" {record['feature']}"
    return (f"{record['direction']} d={record['head_dim']} s={record['seqlen']} {causal}{feature} "
            f"{record['provider']}")


def summarize(runs: list[tuple[int, dict]], trees: list[str]) -> list[str]:
    """One line per cell of ``(tree index, bench record)`` pairs: each tree's median TFLOP/s and
    range, and each later tree's median over the first's. Records without a timing are skipped."""
    cells: dict[tuple, list[list[float]]] = {}
    names: dict[tuple, str] = {}
    for tree, record in runs:
        if "tflops" not in record:
            continue
        key = (record["direction"], record["head_dim"], record["seqlen"], record["causal"],
               record.get("feature", "plain"), record["provider"])
        cells.setdefault(key, [[] for _ in trees])[tree].append(record["tflops"])
        names[key] = cell_name(record)
    lines = []
    for key in sorted(cells):
        parts = [f"{names[key]:44s}"]
        medians = [statistics.median(values) if values else None for values in cells[key]]
        for values, median in zip(cells[key], medians):
            parts.append(f"{median:7.1f} [{min(values):.0f}-{max(values):.0f}] n={len(values)}" if values
                         else "    n/a")
        for median in medians[1:]:
            ratio = median / medians[0] if median and medians[0] else None
            parts.append(f"x{ratio:.3f}" if ratio else "x  n/a")
        lines.append("  ".join(parts))
    return lines


def run_once(tree: str, bench_args: list[str], timeout: float) -> tuple[list[dict], bool]:
    """One ``fmha bench`` process with ``PYTHONPATH`` at ``tree``: the records it wrote (a run cut
    short keeps the cells it finished) and whether it completed."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        command = [sys.executable, "-m", "fmha", "bench", *bench_args, "--jsonl", path]
        try:
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
            ok = proc.returncode == 0
            if not ok:
                print(f"{tree}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
        except subprocess.TimeoutExpired:
            print(f"{tree}: timed out after {timeout:.0f} s", file=sys.stderr)
            ok = False
        if not os.path.exists(path):
            return [], False
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()], ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s --tree A --tree B [--rounds N] -- <fmha bench arguments>")
    parser.add_argument("--tree", action="append", required=True,
                        help="a source tree to import fmha from (its PYTHONPATH); the first is the baseline")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300, help="seconds one bench process may take")
    parser.add_argument("--jsonl", help="append every record, with its tree and round, to this file")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    if len(args.tree) < 2:
        parser.error("--tree: give at least two trees to compare")
    if args.rounds < 1:
        parser.error("--rounds: expected at least 1")
    if any(arg == "--jsonl" or arg.startswith("--jsonl=") for arg in bench_args):
        parser.error("pass --jsonl before '--' (each bench run writes its own file)")
    for tree in args.tree:
        # a tree without fmha would fall back to the installed one and compare it with itself
        if not os.path.isfile(os.path.join(tree, "fmha", "__init__.py")):
            parser.error(f"--tree {tree}: expected a source tree holding fmha/__init__.py (a repo's src/)")
    if args.rounds % len(args.tree):
        print(f"warning: {args.rounds} rounds do not put each of {len(args.tree)} trees first equally often",
              file=sys.stderr)

    runs: list[tuple[int, dict]] = []
    complete = True
    for round_ in range(args.rounds):
        order = [(round_ + i) % len(args.tree) for i in range(len(args.tree))]
        for index in order:
            records, ok = run_once(args.tree[index], bench_args, args.timeout)
            complete = complete and ok
            runs += [(index, record) for record in records]
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    for record in records:
                        f.write(json.dumps({**record, "tree": args.tree[index], "round": round_}) + "\n")
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print("trees: " + "  ".join(f"[{i}] {tree}" for i, tree in enumerate(args.tree)))
    for line in summarize(runs, args.tree):
        print(line)
    return 0 if complete and runs else 1


if __name__ == "__main__":
    sys.exit(main())
