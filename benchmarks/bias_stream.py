"""How fast can one CTA a SM stream an elementwise bias the way the Hopper forward's producer does?

    python benchmarks/bias_stream.py

Persistent CTAs walk a ``[16, 16384, 16384]`` bf16 tensor (the bias of the d = 128, 16k feature
benchmark) one (head, 128-row query tile) at a time, along the keys in TMA boxes, keeping a
given number of boxes in flight (Triton's pipeliner keeps ``stages - 1``), and sum them; it
prints the read's GB/s beside torch's ``sum`` and ``copy_``. ``ahead`` > 0 also issues one
``cp.async.bulk.prefetch.L2`` a row for the key tile that many steps on (``span`` tiles a
prefetch). Session 44 (benchmarks/NOTES.md): the forward's pattern, two 128 x 128 boxes in flight,
reads at the HBM's full speed, and the prefetches only slow it.
"""

import torch
import triton
import triton.language as tl
import triton.testing

HEADS, SEQLEN = 16, 16384
# (rows, keys a box, stages, CTAs a SM, prefetch ahead, span); stages 3 of 128 x 128 is the forward's ring
CASES = [(128, 128, 3, 1, 0, 1), (128, 128, 3, 1, 2, 1), (128, 128, 3, 1, 4, 1), (128, 128, 3, 1, 8, 1),
         (128, 128, 3, 1, 4, 2), (128, 128, 3, 1, 8, 4),
         (128, 128, 2, 1, 0, 1), (128, 128, 4, 1, 0, 1), (128, 128, 5, 1, 0, 1), (128, 128, 3, 2, 0, 1),
         (64, 256, 3, 1, 0, 1), (64, 256, 5, 1, 0, 1), (128, 256, 3, 1, 0, 1), (128, 64, 5, 1, 0, 1),
         (128, 64, 9, 1, 0, 1)]


@triton.jit
def walk(x_ptr, out_ptr, S, H, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr, AHEAD: tl.constexpr,
         SPAN: tl.constexpr):
    n_m = S // BM
    total = tl.zeros([BM, BN], tl.float32)
    for t in range(tl.program_id(0), H * n_m, tl.num_programs(0)):
        h = t // n_m
        m = n_m - 1 - t % n_m  # last query tile first, as the forward's grid runs
        base = x_ptr + h.to(tl.int64) * S * S
        desc = tl.make_tensor_descriptor(base, shape=[S, S], strides=[S, 1], block_shape=[BM, BN])
        rows = base + (m * BM + tl.arange(0, BM)).to(tl.int64) * S
        for n in tl.range(0, S, BN, num_stages=STAGES):
            if AHEAD > 0:
                if (n + AHEAD * BN < S) & ((n // BN) % SPAN == 0):
                    tl.inline_asm_elementwise(f"cp.async.bulk.prefetch.L2.global [$1], {SPAN * BN * 2}; mov.u32 $0, 0;",
                                              "=r,l", [rows + n + AHEAD * BN], dtype=tl.int32, is_pure=False,
                                              pack=1)
            total += desc.load([m * BM, n]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(total))


def gb_per_s(nbytes: int, fn) -> float:
    return nbytes / triton.testing.do_bench(fn, warmup=3, rep=30, return_mode="median") / 1e6


def main() -> None:
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    x = torch.randn(HEADS, SEQLEN, SEQLEN, device="cuda", dtype=torch.bfloat16)
    nbytes = x.numel() * x.element_size()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(2 * sms, device="cuda", dtype=torch.float32)
    print(torch.cuda.get_device_name())
    print(f"torch sum: {gb_per_s(nbytes, lambda: x.sum(dtype=torch.float32)):6.0f} GB/s")
    y = torch.empty_like(x)
    print(f"torch copy (read + write): {gb_per_s(2 * nbytes, lambda: y.copy_(x)):6.0f} GB/s")
    del y
    for bm, bn, stages, ctas_per_sm, ahead, span in CASES:
        launch = walk[(sms * ctas_per_sm,)]
        rate = gb_per_s(nbytes, lambda: launch(x, out, SEQLEN, HEADS, BM=bm, BN=bn, STAGES=stages, AHEAD=ahead,
                                               SPAN=span, num_warps=max(4, bm * bn // 4096)))
        in_flight = (stages - 1) * bm * bn * x.element_size() // 1024
        print(f"box {bm:3d} x {bn:3d}, {in_flight:3d} KB in flight, {ctas_per_sm} CTA/SM, prefetch {ahead} ahead "
              f"x {span}: {rate:6.0f} GB/s")


if __name__ == "__main__":
    main()
