"""Tile configurations: one table, chosen by (dtype, head dim bucket, features), no autotuning.

Each row was measured on the H200 (see benchmarks/NOTES.md). Under Triton's interpreter small
tiles keep the CPU tests fast while still crossing several tiles at ragged lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import INTERPRET


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# block_m stays a multiple of 32: the dropout byte layout works on 32-row tiles.
INTERPRETER_CONFIG = TileConfig(block_m=32, block_n=16, num_warps=1, num_stages=1)

# (dtype kind, head-dim bucket) -> forward tile config; the bucket is the padded head dim.
FWD_CONFIGS: dict[tuple[str, int], TileConfig] = {
    ("half", 16): TileConfig(128, 64, 4, 3),
    ("half", 32): TileConfig(128, 64, 4, 3),
    ("half", 64): TileConfig(128, 64, 4, 3),  # 428 TFLOP/s at s=4k (bf16)
    ("half", 128): TileConfig(128, 64, 8, 3),  # 497 at s=16k; 128x128 tiles 493
    ("half", 256): TileConfig(128, 64, 8, 2),  # 493 at s=16k
    ("fp32", 16): TileConfig(64, 32, 4, 2),
    ("fp32", 32): TileConfig(64, 32, 4, 2),
    ("fp32", 64): TileConfig(64, 32, 4, 2),
    ("fp32", 128): TileConfig(32, 32, 4, 1),
    ("fp32", 256): TileConfig(32, 16, 4, 1),
}


def head_dim_block(head_dim: int) -> int:
    """The padded head dim a kernel works on: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# Feature-specific forward rows, looked up first (see feature_row): (dtype kind, bucket, feature).
# The bias tile and the dropout bytes spill the plain rows' registers (2.4-9.7 KB at d=128/64);
# bf16, s=16k, TFLOP/s against the plain row in the same sweep (benchmarks/tune_fwd.py).
FWD_FEATURE_CONFIGS: dict[tuple[str, int, str], TileConfig] = {
    ("half", 64, "bias"): TileConfig(128, 64, 8, 3),  # 102
    ("half", 64, "dropout"): TileConfig(128, 64, 8, 3),  # 65
    ("half", 64, "bias+dropout"): TileConfig(128, 64, 8, 3),  # 43
    ("half", 128, "bias"): TileConfig(128, 32, 8, 3),  # 105 against 67
    ("half", 128, "bias+dropout"): TileConfig(128, 32, 8, 3),  # 74 against 48
    ("half", 256, "bias"): TileConfig(128, 32, 8, 2),  # 129
    ("half", 256, "dropout"): TileConfig(128, 32, 8, 2),  # 169
    ("half", 256, "bias+dropout"): TileConfig(128, 16, 8, 2),  # 100 against 90 at (128, 32)
}


def feature_row(table: dict, dtype: torch.dtype, bucket: int, has_bias: bool, has_dropout: bool):
    """The row of a feature table for these features, or None: "bias+dropout" when both are on,
    else (or when there is no such row) "bias", then "dropout" — a bias row's smaller tiles keep
    their reason (shared memory, registers) when dropout comes on top."""
    wanted = [("bias+dropout", has_bias and has_dropout), ("bias", has_bias), ("dropout", has_dropout)]
    for feature, on in wanted:
        if on and (_kind(dtype), bucket, feature) in table:
            return table[(_kind(dtype), bucket, feature)]
    return None


def fwd_config(dtype: torch.dtype, head_dim_q: int, head_dim_v: int, has_bias: bool = False,
               has_dropout: bool = False) -> TileConfig:
    if INTERPRET:
        return INTERPRETER_CONFIG
    bucket = max(head_dim_block(head_dim_q), head_dim_block(head_dim_v))
    row = feature_row(FWD_FEATURE_CONFIGS, dtype, bucket, has_bias, has_dropout)
    return row or FWD_CONFIGS[(_kind(dtype), bucket)]


def _kind(dtype: torch.dtype) -> str:
    """fp16 and bf16 share tiles; fp32 and fp64 (CUDA-core math) share the small ones."""
    return "fp32" if dtype in (torch.float32, torch.float64) else "half"


@dataclass(frozen=True)
class BwdConfig:
    """Tiles of the dK/dV kernel (``block_m`` queries x ``block_n`` keys) and of the dQ kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_m_dq: int
    block_n_dq: int
    num_warps_dq: int
    num_stages_dq: int


INTERPRETER_BWD_CONFIG = BwdConfig(32, 16, 1, 1, 32, 16, 1, 1)

BWD_CONFIGS: dict[tuple[str, int], BwdConfig] = {
    ("half", 16): BwdConfig(64, 128, 8, 2, 128, 32, 8, 3),
    ("half", 32): BwdConfig(64, 128, 8, 2, 128, 32, 8, 3),
    ("half", 64): BwdConfig(64, 128, 8, 2, 128, 32, 8, 3),
    ("half", 128): BwdConfig(64, 128, 8, 2, 128, 64, 8, 3),
    ("half", 256): BwdConfig(32, 64, 8, 2, 128, 32, 8, 3),
    ("fp32", 16): BwdConfig(32, 32, 4, 1, 32, 32, 4, 1),
    ("fp32", 32): BwdConfig(32, 32, 4, 1, 32, 32, 4, 1),
    ("fp32", 64): BwdConfig(32, 32, 4, 1, 32, 32, 4, 1),
    ("fp32", 128): BwdConfig(32, 32, 4, 1, 32, 32, 4, 1),
    ("fp32", 256): BwdConfig(32, 16, 4, 1, 32, 16, 4, 1),
}


# Feature-specific backward rows, looked up first (see feature_row).
BWD_FEATURE_CONFIGS: dict[tuple[str, int, str], BwdConfig] = {
    # The bias tile's buffers push the 3-stage dQ kernel to 237568 B of shared memory (232448 fit).
    ("half", 256, "bias"): BwdConfig(32, 64, 8, 2, 128, 32, 8, 2),
}


def bwd_config(dtype: torch.dtype, head_dim_q: int, head_dim_v: int, has_bias: bool = False,
               has_dropout: bool = False) -> BwdConfig:
    if INTERPRET:
        return INTERPRETER_BWD_CONFIG
    bucket = max(head_dim_block(head_dim_q), head_dim_block(head_dim_v))
    row = feature_row(BWD_FEATURE_CONFIGS, dtype, bucket, has_bias, has_dropout)
    return row or BWD_CONFIGS[(_kind(dtype), bucket)]


@dataclass(frozen=True)
class HopperFwdConfig:
    """The Gluon Hopper forward: ``consumers`` warpgroups of 64 query rows, keys in ``block_n``
    tiles through a ``stages``-deep TMA ring; ``consumer_regs`` per consumer thread (setmaxnreg)
    within the kernel-wide ``maxnreg``: (consumers + 1) * 128 threads * maxnreg <= 65536.
    Sequences shorter than ``min_seqlen`` (``min_seqlen_causal`` under a causal mask) run the
    portable kernels, which measured faster there, unless they run persistent CTAs."""

    block_n: int
    stages: int
    consumers: int
    consumer_regs: int
    maxnreg: int
    min_seqlen: int = 0
    min_seqlen_causal: int = 0
    causal_alibi: bool = True  # ALiBi under a causal mask (slope * j) on the fast path
    # ALiBi's -slope * |i - j| without a window or dropout as a column term in the scale's FMA and
    # a row term in m, off the diagonal (its tiles apart): the column terms' registers must fit
    # (d=64 spills 392 B, with dropout d=128 3996 B)
    alibi_linear: bool = False
    # ... with the column term added to S by the tensor cores (a k16 wgmma of the slope in three 16-bit
    # pieces against each key's column in its tile), so the softmax does no per-score ALiBi work
    alibi_mma: bool = False
    # Persistent CTAs (one per SM, running tiles in turn) up to these lengths, one CTA per tile
    # above them (0: never); not for ALiBi or group mode.
    persistent_max_seqlen: int = 0
    persistent_max_seqlen_causal: int = 0
    # A sliding window alone runs persistent CTAs where its band (the keys one query tile sees) is
    # at most ``persistent_max_seqlen`` keys, whatever the length, with consumers of this many
    # registers (0: one CTA per tile; two consumers leave the producer warp 504 - 2 * them).
    persistent_window_regs: int = 0
    # Persistent CTAs load a tile's Q during the tile before, into a second Q buffer (2), where
    # shared memory holds it (d=256 does not: 1, loaded as the tile starts).
    persistent_q_bufs: int = 1
    bias: bool = False  # an elementwise bias tile through the K ring (its shared memory must fit)
    # Dropout runs two consumers of ``dropout_consumer_regs`` beside a warpgroup that
    # streams K/V and makes the masks (the default partition): 12 warps at 168 registers a thread,
    # of which that warpgroup gets what the consumers leave of 64K, 504 - 2 * dropout_consumer_regs.
    dropout_consumer_regs: int = 216
    dropout_alibi: bool = True  # ALiBi with dropout on the fast path
    # A bias with dropout takes keys in tiles of this many through a ring this deep (0: the portable
    # kernels): with 128 the bias and mask rings together overflow shared memory.
    bias_dropout_block_n: int = 0
    bias_dropout_stages: int = 2
    # Group-mode windows (without ALiBi: at d=64 two consumers spill 8 B with it, three none) in
    # two consumers of 240 registers (the dropout forward's register split without dropout's
    # warpgroup) where ``consumers`` of ``consumer_regs`` spill there.
    group_window_two_consumers: bool = False
    # P rounded for the PV wgmma two elements a cvt (32 PRMTs fewer a d=128 step; d=256, 16k: 700
    # TFLOP/s against 670, H100, medians of four runs); at d=64 the three consumers spill 304 B with it
    packed_p: bool = False


# head dim -> config (fp16 and bf16 alike); all compile for sm_90a without spills.
HOPPER_FWD_CONFIGS: dict[int, HopperFwdConfig] = {
    # d=64, 16k tokens, TFLOP/s, portable against this kernel. Causal, graph replay: 1k 254 against
    # 153, 2k 308 against 261, 4k 346 against 348; fmha bench 1k 171 against 153, 2k 322 against
    # 256; H100, session 47 (warpgroups skipping unseen edge tiles), fmha bench: 1k 266 against 192,
    # 2k 329 against 312, 4k 362 against 398. One CTA of 192 rows per SM pays its fill and drain on
    # few key tiles; two portable CTAs per SM hide each other's. Where the persistent form runs
    # (below its limits, no features) it wins: 1k 387 / 386 against 372 / 372 (fmha bench, two
    # rounds; 131072 tokens 410 / 403 against 392 / 393), so ``min_seqlen`` does not apply there.
    # With ALiBi under a causal mask ptxas spills 360 B here (at d=128/256 nothing).
    # Persistent against one CTA per tile (same build, CUDA graphs, bf16, 16k tokens): 1k 1.12,
    # 4k 0.99, 16k 0.98; causal 1k 1.42, 4k 0.95, 16k 0.91, but causal persistent spills 8 B.
    # In group mode with a window three consumers spill 368 B (one consumer's edge loop, 43 LDL a
    # step; which one follows the partition order): two consumers there.
    64: HopperFwdConfig(128, 3, 3, 160, 128, min_seqlen=2048, min_seqlen_causal=4096, causal_alibi=False,
                        persistent_max_seqlen=2048, persistent_q_bufs=2, group_window_two_consumers=True,
                        persistent_window_regs=160),
    # 623 TFLOP/s at s=16k (bf16). Persistent: 1k 1.24 (591 against 477), 4k 1.01, 16k 1.00; causal
    # 4k 0.91, 16k 0.88 (static turns balance causal tiles worse than the hardware's dispatch), and
    # at 1k 0.77 on an H100 (session 35, graph replay: 263 / 261 against 341 / 347; cuDNN 387 / 394),
    # though an earlier build measured 1.06 on the H200: causal runs one CTA per tile.
    # Persistent, a window's consumers of 240 registers spill 40 B outside the loops (producer 24;
    # 44 B with packed_p), of 224 none, but run 292 us against 274 (H100, 16k b:1024,0; per tile
    # 292): 240, accepted by compile_check.ACCEPTED_SPILLS.
    # ALiBi by wgmma (alibi_mma) and packed_p, H100, 16k, medians of five runs: ALiBi 609 TFLOP/s
    # against 564 (the scale-FMA form), window 469 against 456; plain, bias and dropout within noise.
    128: HopperFwdConfig(128, 2, 2, 240, 168, persistent_max_seqlen=2048, persistent_window_regs=240,
                         persistent_q_bufs=2, bias=True, bias_dropout_block_n=64, bias_dropout_stages=3,
                         alibi_linear=True, alibi_mma=True, packed_p=True),
    # 718 at s=16k. Persistent: 1k 1.09, 4k 0.98, 16k 0.97; causal 1k 0.86, 4k 0.93, 16k 0.86.
    # With dropout and a window 216 consumer registers spill 12 B, 224 none; with ALiBi too 56 B.
    256: HopperFwdConfig(64, 2, 2, 240, 168, persistent_max_seqlen=2048, persistent_window_regs=240, bias=True,
                         dropout_consumer_regs=224,
                         dropout_alibi=False, alibi_linear=True, alibi_mma=True, packed_p=True),
}


@dataclass(frozen=True)
class HopperBwdConfig:
    """The Gluon Hopper backward: 128 keys per CTA in two consumer warpgroups, queries in
    ``block_m`` tiles through a ``stages``-deep ring, ``ds_bufs`` shared dS tiles. It runs every
    problem it covers: at d=64, 1k, causal it measured 155-204 TFLOP/s against the portable
    backward's 156-173 in the same runs."""

    block_m: int
    stages: int
    ds_bufs: int
    consumer_regs: int
    maxnreg: int
    dq_cols: int = 0  # d=256 (64 keys per CTA, the warpgroups split the head dim): dQ piece width
    windows_and_alibi: bool = True  # sliding windows and ALiBi on the fast path (not the d=256 kernel)
    feature_block_m: int = 0  # the query tile in group mode or with a window or ALiBi (0: block_m)
    # The deterministic mode's dQ accumulator copies per head (0: the portable kernels; see
    # hopper_bwd's ``_rank`` and the wide kernel's order): with more a CTA has more steps of slack
    # before it waits for its turn to add, and each costs 4 * numel(q) bytes written and summed. In
    # the narrow kernel with one query tile a key tile (block_m 128) at least three, else the turns
    # deadlock.
    deterministic_chains: int = 0
    # ... under a causal mask from this many queries on (0: never), this many copies instead
    long_causal_seqlen: int = 0
    long_causal_chains: int = 0
    deterministic_block_m: int = 0  # the deterministic mode's query tile (0: as in atomic mode)
    # The wide kernel (d=256): while a head's key tiles fit the SMs, its DIAGONAL order (see
    # hopper_bwd) with this many copies (0: the aligned order throughout)
    diagonal_chains: int = 0
    # An elementwise bias (without its gradient) on the fast path: one slot of [block_m, 64] bias
    # tiles per warpgroup beside the rings, in the feature query tile (its shared memory must fit).
    bias: bool = False
    # ... with its gradient: dS^T stored by the producer into a transposed buffer, then transposed
    # (at d=128, 16k: 280 TFLOP/s against 436 without the gradient; SDPA mem-eff's runs 113)
    bias_grad: bool = False
    # P^T and dS^T as register operands of the dV and dK wgmma in 64-row query tiles (with 128
    # rows they spill), instead of shared-memory tiles: the wgmma's operand reads share the
    # shared memory's bandwidth, and dK no longer waits for the other warpgroup's dS^T (d=64 with
    # ALiBi / a bias: 1.04 / 1.03 of the smem operands, measured before dK moved ahead)
    dkv_rs: bool = False
    # Dropout (64-row query tiles, batch mode, no bias, atomic mode) on the fast path: two consumers
    # of ``dropout_consumer_regs`` beside a producer warpgroup that also makes the masks, 12 warps
    # at 168 registers a thread, of which the producer gets 504 - 2 * dropout_consumer_regs (40:
    # it makes the masks 32 keys at a time). ``dropout_features``: with a sliding window, ALiBi or
    # GQA too.
    dropout: bool = False
    dropout_consumer_regs: int = 232
    dropout_features: bool = True

    def block_m_for(self, features: bool) -> int:
        return self.feature_block_m if features and self.feature_block_m else self.block_m

    def chains_for(self, causal: bool, seqlen: int) -> int:
        """The deterministic mode's dQ copies per head for a problem."""
        if causal and self.long_causal_seqlen and seqlen >= self.long_causal_seqlen:
            return self.long_causal_chains
        return self.deterministic_chains


HOPPER_BWD_CONFIGS: dict[int, HopperBwdConfig] = {
    # 437 TFLOP/s at s=16k (bf16); 128-row query tiles spill in group mode and with a window and
    # ALiBi (24 and 8 B), 64-row ones do not
    # Deterministic, of atomic (H100, 1k / 4k / 16k, plain | causal), 64-row query tiles: two dQ
    # copies 0.96-0.97 0.97 0.91-0.92 | 0.96 0.93 0.68, three 0.89 0.95 0.89 | 0.87 0.87 0.87;
    # 128-row tiles (whose first adds cannot be stores: 32 B spilled) with three copies 0.80-0.82
    # 0.97 0.94-1.0 | 0.77 0.89 0.83-0.95 (two deadlock).
    64: HopperBwdConfig(128, 2, 2, 240, 168, feature_block_m=64, deterministic_chains=2, long_causal_seqlen=12288,
                        long_causal_chains=3, deterministic_block_m=64, bias=True, bias_grad=True, dkv_rs=True,
                        dropout=True),
    # 503 at s=16k (causal 498), 477 (460) with P^T and dS^T from shared memory, which also spilled
    # 28 B with a bias, GQA and a causal mask
    # With dropout at 232 registers a window, ALiBi under a causal mask and GQA under one spill 8-32 B.
    # Deterministic, of atomic (H100, two rounds, 1k / 4k / 16k, plain | causal): two dQ copies
    # 0.94 0.96-0.98 0.84-0.95 | 0.95 0.93-0.97 0.81; three 0.83-0.86 0.89 0.84-0.91 | 0.84 0.89 0.89-0.92
    # (a copy's bytes weigh more in a shorter sequence; a longer causal one waits more for its turns:
    # 8k and 12k causal about even).
    128: HopperBwdConfig(64, 2, 2, 240, 168, deterministic_chains=2, long_causal_seqlen=12288, long_causal_chains=3,
                         bias=True, bias_grad=True, dkv_rs=True, dropout=True, dropout_features=False),
    # one P/dS tile pair (ds_bufs 1); 308 at s=16k
    # Deterministic, of atomic (H100, 1k / 4k / 16k, plain | causal): aligned order, two copies
    # 0.83 0.88 0.97 | 0.73 0.66 0.74, three 0.84-0.86 0.95 0.99 | 0.75 0.77 0.87 (8 B spilled),
    # four 0.84 0.975 0.97 | - 0.81 0.86; the causal DIAGONAL order, two copies 0.95 0.91 0.61,
    # three 0.80 0.68 0.49. Shipped (the diagonal order, with or without a mask, while a head's key
    # tiles of 64 fit the SMs, else aligned with four copies), two rounds: 1.02-1.03 1.01-1.03
    # 0.96-0.98 | 0.94-0.95 0.89-0.94 0.88-0.91.
    256: HopperBwdConfig(64, 2, 1, 240, 168, dq_cols=32, windows_and_alibi=False, deterministic_chains=4,
                         diagonal_chains=2),
}
