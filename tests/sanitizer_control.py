"""Gluon kernels holding little but ``gl.warp_specialize``, for ``sanitizer_cases.py control``.

A 4-warp default partition and a 1-warp worker each store to global memory. ``BARRIER`` adds a
barrier among the default partition's warps (which Triton lowers to ``bar.sync 0, 128``, as in
fmha's kernels); ``MBARRIER`` makes the worker wait on an mbarrier the default partition arrives
on (fmha's handshake). Whatever racecheck reports here comes from Triton's warp-specialization
scaffolding (the partition-state bytes that worker warps read after a named barrier) or from how
racecheck models these barriers, not from fmha's kernels. Imported only on a CUDA device: Triton's
interpreter has no Gluon.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _default_partition(out_ptr, bar, BARRIER: gl.constexpr, MBARRIER: gl.constexpr):
    offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
    if BARRIER:
        gl.thread_barrier()
    gl.store(out_ptr + offs, 1.0)
    if MBARRIER:
        mbarrier.arrive(bar)


@gluon.jit
def _worker_partition(out_ptr, bar, BARRIER: gl.constexpr, MBARRIER: gl.constexpr):
    if MBARRIER:
        mbarrier.wait(bar, 0)
    gl.store(out_ptr + 128 + gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0])), 2.0)


@gluon.jit
def warp_specialize_control_kernel(out_ptr, BARRIER: gl.constexpr, MBARRIER: gl.constexpr):
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    gl.warp_specialize([(_default_partition, (out_ptr, bar, BARRIER, MBARRIER)),
                        (_worker_partition, (out_ptr, bar, BARRIER, MBARRIER))], [1], [24])
