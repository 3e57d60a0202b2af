"""Draw fmha against its peers from ``fmha bench`` JSON lines: one panel per (direction, head dim).

    python benchmarks/plot.py benchmarks/results/h200-fwd-bf16.jsonl benchmarks/results/h200-bwd-bf16.jsonl \
        -o docs/perf-h200.png

When a cell was measured more than once, its latest run beside cuDNN wins; ``--commit`` keeps only the
records of the given commits (one run of the grid, not a mix of sessions). Needs matplotlib
(``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# provider -> (legend label, colour), the same colour in every panel
STYLE = {
    "fmha": ("fmha", "tab:blue"),
    "fmha_deterministic": ("fmha deterministic", "tab:cyan"),
    "sdpa_cudnn": ("cuDNN (SDPA)", "tab:green"),
    "sdpa_flash": ("SDPA flash", "tab:red"),
    "sdpa_efficient": ("SDPA mem-eff", "tab:purple"),
    "flex": ("FlexAttention", "tab:brown"),
}


def latest_cells(paths: list[str], commits: list[str] | None = None) -> dict[tuple, dict[str, float]]:
    """``{(direction, head_dim, seqlen, causal): {provider: tflops}}`` of the plain cases, each
    cell from its latest run that timed cuDNN beside fmha (a run of a cell starts at its fmha
    record, which ``fmha bench`` writes first; runs without cuDNN, such as a ``--features`` run's
    plain references, are not grid cells); only records of ``commits`` when given."""
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    if commits:
        records = [r for r in records if r.get("commit") in commits]
    records.sort(key=lambda r: r["time"])
    runs: dict[tuple, dict[str, float]] = {}  # each cell's latest run so far
    cells: dict[tuple, dict[str, float]] = {}
    for r in records:
        if "tflops" not in r or r.get("feature", "plain") != "plain":  # feature rows are not grid cells
            continue
        key = (r["direction"], r["head_dim"], r["seqlen"], r["causal"])
        if r["provider"] == "fmha":
            runs[key] = {}
        run = runs.setdefault(key, {})
        run[r["provider"]] = r["tflops"]
        if "fmha" in run and "sdpa_cudnn" in run:
            cells[key] = run
    return cells


def plot(cells: dict[tuple, dict[str, float]], out: str, title: str) -> None:
    directions = sorted({k[0] for k in cells}, key=["fwd", "bwd"].index)
    head_dims = sorted({k[1] for k in cells})
    fig, axes = plt.subplots(len(directions), len(head_dims), figsize=(5 * len(head_dims), 3.6 * len(directions)),
                             squeeze=False, sharey="row")
    for row, direction in enumerate(directions):
        providers = [p for p in STYLE if any(p in v for k, v in cells.items() if k[0] == direction)]
        width = 0.8 / len(providers)
        for col, d in enumerate(head_dims):
            ax = axes[row][col]
            keys = sorted(k for k in cells if k[0] == direction and k[1] == d)
            for i, provider in enumerate(providers):
                xs = [x + (i - (len(providers) - 1) / 2) * width for x in range(len(keys))]
                ys = [cells[k].get(provider, 0.0) for k in keys]
                label, colour = STYLE[provider]
                ax.bar(xs, ys, width, label=label, color=colour)
            ax.set_xticks(range(len(keys)))
            ax.set_xticklabels([f"{k[2] // 1024}k{' causal' if k[3] else ''}" for k in keys], fontsize=8)
            ax.set_title(f"{'forward' if direction == 'fwd' else 'backward'}, d={d}", fontsize=10)
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            ax.grid(axis="y", alpha=0.3)
        axes[row][0].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", nargs="+")
    parser.add_argument("-o", "--out", default="docs/perf-h200.png")
    parser.add_argument("--title", default="bf16, 16k tokens per batch, h = 2048/d, NVIDIA H200")
    parser.add_argument("--commit", nargs="+", help="only the records of these commits")
    args = parser.parse_args()
    cells = latest_cells(args.jsonl, args.commit)
    if not cells:
        parser.error("no plain-case records" + (f" of commit {', '.join(args.commit)}" if args.commit else ""))
    plot(cells, args.out, args.title)


if __name__ == "__main__":
    main()
