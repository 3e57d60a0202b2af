"""Where a Hopper kernel's instructions and warp time go, from its SASS (benchmarks/NOTES.md, session 26).

    TRITON_INTERPRET=0 python benchmarks/sass_profile.py loops "hopper bfloat16 d=128 [plain] fwd bias" \
        --head-dim 128 [--causal]
    python benchmarks/sass_profile.py stalls prof.csv
    TRITON_INTERPRET=0 python benchmarks/sass_profile.py waits "hopper bfloat16 d=128 [plain] bwd \
        attention_bwd_hopper_kernel" --head-dim 128

``loops`` compiles one launch of ``fmha.compile_check`` (named as it prints them) for sm_90 on the
CPU, disassembles its cubin with the nvdisasm that ships with Triton (``asm["sass"]`` stops at
4,096 instructions) and prints every innermost loop of more than 100 instructions: a loop is a
backward branch's span, so a step's count includes branches not taken.

``stalls`` reads ncu's source page of one launch (``ncu --section SourceCounters --import-source
yes -o prof ...``, then ``ncu -i prof.ncu-rep --page source --csv --print-source sass > prof.csv``)
and sums its warp-stall samples, which are proportional to warp time, by partition and instruction
kind. A warp-specialized kernel's partitions each start with a ``USETMAXREG``; the samples on a
NOP after one are warps parked at the end barrier, not work.

``waits`` assembles the launch's PTX with ``ptxas -v`` and prints ptxas's notes on the wgmma it
serializes: "warpgroup.wait is injected" (C7517) means a wgmma the source leaves in flight is
waited for before the named PTX line, so two wgmma meant to queue together do not (session 29:
the backward's dP^T waited for S^T because dP^T's accumulator started from loaded values).
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile

PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def opcode(instruction: str) -> str:
    """``@!P0 IMAD.WIDE.U32 R2, ...`` -> ``IMAD.WIDE.U32``."""
    return PREDICATE.sub("", instruction.strip()).split(" ")[0].rstrip(";")


def nvdisasm_lines(cubin: bytes) -> list[str]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()


def loops(lines: list[str], min_size: int = 100) -> list[tuple[str, int, collections.Counter]]:
    """(label, instructions, opcode counts) of each innermost loop (a backward branch's span holding
    no other) of more than ``min_size`` instructions, in nvdisasm -c output."""
    labels, code = {}, []  # label -> index into code; code: the instructions in order
    for line in lines:
        if re.match(r"^\.L_x_\d+:$", line.strip()):
            labels[line.strip()[:-1]] = len(code)
        elif re.match(r"^\s*/\*[0-9a-f]{4,}\*/", line):
            code.append(line.split("*/", 1)[1].strip())
    spans = []
    for i, instruction in enumerate(code):
        target = re.search(r"BRA `\((\.L_x_\d+)\)", instruction)
        if target and labels.get(target.group(1), len(code)) <= i:
            spans.append((labels[target.group(1)], i, target.group(1)))
    innermost = [(a, b, name) for a, b, name in spans
                 if not any(a <= a2 and b2 <= b and (a2, b2) != (a, b) for a2, b2, _ in spans)]
    return [(name, b + 1 - a, collections.Counter(opcode(x).split(".")[0] for x in code[a:b + 1]))
            for a, b, name in innermost if b + 1 - a > min_size]


def compile_one(name: str, head_dim: int, causal: bool, kind: str = "cubin"):
    """The launch's ``asm[kind]`` (``cubin``, ``ptx``, ``ttgir``, ...), compiled for sm_90."""
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    from triton.runtime.driver import driver

    from fmha import compile_check as cc

    driver.set_active(cc._HopperCompileOnly())
    outputs = {}

    def keep(launch, kernel, grid, kwargs):
        if launch == name:
            outputs[name] = kernel.warmup(grid=grid, **kwargs).asm[kind]
        return cc.Result(launch, 0, 0, 0)

    cc._compile = keep
    dtype = torch.bfloat16 if "bfloat16" in name else torch.float16
    cc.check_hopper(dtype, head_dim, causal)
    if name not in outputs:
        sys.exit(f"no launch named {name!r} at head dim {head_dim}, causal {causal}")
    return outputs[name]


def injected_waits(ptx: str) -> list[str]:
    """ptxas's C75xx notes (injected wgmma waits and arrives) on this PTX, assembled for sm_90a."""
    os.environ["TRITON_INTERPRET"] = "0"
    from fmha.compile_check import ptxas_log

    return [line for line in ptxas_log(ptx).splitlines() if "(C75" in line]


def stall_kind(instruction: str, previous: str) -> str:
    op = opcode(instruction)
    if op.startswith("HGMMA"):
        return "wgmma issue"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "wgmma wait"
    if op == "BRA" and "TRYWAIT" in previous:
        return "mbarrier wait"
    if op.startswith("MUFU"):
        return "MUFU"
    if op.startswith(("LDS", "STS", "LDSM", "STSM")):
        return "shared ld/st"
    if op.startswith(("SYNCS", "BAR")):
        return "barrier ops"
    return "ALU and other"


def stalls(path: str) -> dict[str, collections.Counter]:
    """Warp-stall samples per partition (numbered from the kernel's start, named by its register
    count) and kind, from an ncu source CSV."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if "Warp Stall Sampling (All Samples)" in r)
    cols = rows[head]
    samples, source = cols.index("Warp Stall Sampling (All Samples)"), cols.index("Source")
    parts: dict[str, collections.Counter] = {}
    part, previous, segment = "entry", "", 0
    for row in rows[head + 1:]:
        instruction = row[source]
        setmaxreg = re.search(r"USETMAXREG\.\S+ (?:\w+, )?(0x[0-9a-f]+)", instruction)
        if setmaxreg:
            segment += 1
            part = f"{segment}: {int(setmaxreg.group(1), 16)} regs"
        kind = "parked (NOP)" if opcode(instruction) == "NOP" else stall_kind(instruction, previous)
        parts.setdefault(part, collections.Counter())[kind] += float(row[samples] or 0)
        previous = instruction
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("loops")
    lp.add_argument("name")
    lp.add_argument("--head-dim", type=int, required=True)
    lp.add_argument("--causal", action="store_true")
    sp = sub.add_parser("stalls")
    sp.add_argument("csv")
    wp = sub.add_parser("waits")
    wp.add_argument("name")
    wp.add_argument("--head-dim", type=int, required=True)
    wp.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    if args.command == "loops":
        for label, size, ops in loops(nvdisasm_lines(compile_one(args.name, args.head_dim, args.causal))):
            print(f"{label:8s} {size:5d}: " + " ".join(f"{op} {n}" for op, n in ops.most_common(14)))
    elif args.command == "waits":
        notes = injected_waits(compile_one(args.name, args.head_dim, args.causal, "ptx"))
        print("\n".join(notes) if notes else "ptxas injected no wgmma waits or arrives")
    else:
        parts = stalls(args.csv)
        total = sum(sum(c.values()) for c in parts.values())
        for part, kinds in parts.items():
            n = sum(kinds.values())
            if n > 0.01 * total:
                kinds_text = "  ".join(f"{k} {v / 1000:.1f}" for k, v in kinds.most_common())
                print(f"{part:16s} {n / 1000:8.1f}k  {kinds_text}")


if __name__ == "__main__":
    main()
