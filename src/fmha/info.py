"""``fmha info``: versions, the GPU, and which features run on this machine (and why not)."""

from __future__ import annotations

import importlib.util
import platform

import torch
import triton

from . import __version__, hopper
from .kernels import INTERPRET


def _capability() -> tuple[int, int] | None:
    if INTERPRET or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def environment() -> list[tuple[str, str]]:
    rows = [("fmha", __version__), ("python", platform.python_version()), ("torch", torch.__version__),
            ("triton", triton.__version__)]
    cap = _capability()
    if cap is None:
        reason = "TRITON_INTERPRET=1" if torch.cuda.is_available() else "no CUDA device"
        rows.append(("device", f"CPU through Triton's interpreter ({reason})"))
    else:
        rows.append(("device", f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]}, "
                               f"{torch.cuda.get_device_properties(0).multi_processor_count} SMs)"))
    return rows


def features() -> list[tuple[str, bool, str]]:
    """(feature, available here, how it runs or why it does not)."""
    cap = _capability()
    gpu = cap is not None
    interpreted = "through the interpreter: correct, slow"
    hopper_off = hopper.device_unsupported(torch.device("cuda" if gpu else "cpu"))
    rows = [
        ("forward and backward kernels", True, "compiled for this GPU" if gpu else interpreted),
        ("fp16, fp32, fp64 inputs", True, "yes (fp64 is for gradcheck: CUDA cores on a GPU)"),
        ("bf16 inputs", not gpu or cap >= (8, 0),
         "needs compute capability 8.0 or newer" if gpu and cap < (8, 0) else "yes"),
        ("masks, bias and dbias, ALiBi, dropout (CK's bytes), GQA/MQA, group mode", True, "yes"),
        ("deterministic backward", True, "bitwise repeatable, no workspace"),
        ("Hopper fast path (Gluon, warp-specialized)", hopper_off is None,
         hopper_off or ("forward and atomic backward d 64/128/256, deterministic backward d 64/128: "
                        "fp16/bf16, seqlen_q == seqlen_k, GQA/MQA; windows and ALiBi (the backward not at "
                        "d 256), an elementwise bias (forward d 128/256, backward d 64/128), dropout in batch "
                        "mode (forward d 64/128/256, backward d 64/128), varlen with one seqstart (the "
                        "backward not at d 256); persistent forward CTAs for short sequences; the portable "
                        "kernels take the rest (fmha.hopper.fwd_unsupported / bwd_unsupported say why)")),
        ("TMA bulk dQ reduction (atomic backward)", gpu and cap >= (9, 0),
         "Hopper or newer" if gpu and cap >= (9, 0) else
         ("needs compute capability 9.0; per-element atomics instead" if gpu else "GPU only; per-element path")),
        ("torch.compile without graph breaks", True,
         "fmha::fwd and fmha::bwd custom ops; varlen needs max_seqlen_q/k and no seqstart_padded_q"),
    ]
    flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    rows.append(("fmha bench peers: SDPA backends, FlexAttention", gpu,
                 ("FlexAttention found" if flex else "FlexAttention missing from this torch") if gpu
                 else "benchmarks need a GPU"))
    plot = importlib.util.find_spec("matplotlib") is not None
    rows.append(("benchmarks/plot.py", plot, "matplotlib found" if plot else "pip install -e '.[bench]'"))
    return rows


def report() -> str:
    lines = [f"{name:8s} {value}" for name, value in environment()]
    lines.append("")
    for name, ok, why in features():
        lines.append(f"{'yes' if ok else 'no ':3s}  {name}: {why}")
    return "\n".join(lines)
