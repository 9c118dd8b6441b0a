"""Tuning of the kernels in one place: the M thresholds of the dispatch (`linear.path`), the layout switches of the
tensor-core GEMV and the rotation, the programmatic-dependent-launch limits, and the MoE op's plan limits (pairs
served by the decode GEMVs, the fused routed products, the prefill scratch budget). Module globals, read at each
call (tests and benchmarks set them here). Measurements behind them: benchmarks/RESULTS.md and benchmarks/E2E.md.

`GENERATION` counts the assignments to this module's attributes: the launch plans that the dispatch derives from
these values (`launch.memo`) are keyed on it, so that setting any of them takes effect at the next call."""

from __future__ import annotations

import sys
import types

from turboquant_hf import settings


class _Tuning(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name != "GENERATION":
            super().__setattr__("GENERATION", self.GENERATION + 1)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        super().__setattr__("GENERATION", self.GENERATION + 1)


GENERATION = 0
if __name__ in sys.modules:  # (a copy loaded from the file alone, as a test does, keeps the plain module type)
    sys.modules[__name__].__class__ = _Tuning

# Largest M served by the tensor-core GEMV; above it: dequantize + cuBLAS.
DOT_MAX_M = 16

# Whether the tensor-core GEMV reads activations that the rotation wrote in its order (`_mma_column`, `x_order`),
# for weights of at least X_ORDER_MIN values (rows x padded inputs); smaller weights keep the natural order
# (measurements: benchmarks/RESULTS.md). Keyed on the weight shape, never on M.
X_ORDER = True
X_ORDER_MIN = 1 << 22

# Largest M served by the FMA GEMV for 16-bit activations (float32 always uses it up to DOT_MAX_M).
FMA_MAX_M = 1

# Largest M served by the tensor-core GEMV with 32 activation rows a program (DOT_MAX_M < M, 16-bit activations,
# 2-, 3- and 4-bit weights; `_mid_config`); 0: none, every M above DOT_MAX_M dequantizes for cuBLAS.
MID_MAX_M = 64

# Activation rows up to which `rotate` runs the butterfly kernel (`_rotate_rows_kernel`, faster at small M, the same
# output bit for bit) rather than the tensor-core one. ROWS_CONFIG, when set, overrides `_rows_config`.
ROWS_MAX_M = 16
ROWS_CONFIG = None
# Rows a program of the tensor-core rotation above ROWS_MAX_M (0: 64 for 16-bit activations, else 16).
ROTATE_BM = 0

# Which index numbers j of a unit are looked up with a load from the codebook (bit j set) rather
# than a tree of selects: the mix that balances the load/store and integer pipes (the codebook
# loads cost ~4 cycles of the load/store unit per warp, the selects 3/7/15 integer ops per weight).
LUT_MASKS = {3: 0x5, 4: 0x0, 8: 0x11111111, 16: 0x55555555}

# Largest M served by the pair GEMV, which decodes the weight once for BM = 1 or 2 activation rows (above it the
# tensor-core GEMV or dequantize + cuBLAS; the kernel also takes BM = 4, slower than the tensor cores there).
PAIR_MAX_M = 2

# Wide blocks: 3-bit weights at G = 128 take blocks of two groups (KB = 256 inputs, each lane two consecutive units,
# the group norms folded into the 16-bit values: `FOLD`) instead of one. A lane's words are then 8 consecutive
# bytes of each of the unit's three planes, and the four lanes of a weight row read a whole 32-byte sector per
# load, where blocks of one group use half of each sector per load instruction and leave the other half to the
# next block's load. Used for weights of at least WIDE_MIN values with an even number of groups, below 16384 rows at
# M <= DOT_MAX_M, any rows up to 2 DOT_MAX_M, and from 8192 rows above that (benchmarks/RESULTS.md). The cost is
# precision: each value times its norm is rounded to 16 bits (relative error of the product 3.3e-3 against 2.6e-3
# with one group a block, bfloat16, random data), about a fiftieth of the 3-bit quantization error itself.
WIDE = True
WIDE_MIN = 1 << 22

# Longest rotated row (n_groups * G) whose rotation and GEMV use programmatic dependent launch (longer rows lose
# by it); PDL_MAX_K_PAIRS: the same for the 3- and 4-bit pair GEMV of one activation row (`_pair_config`), at M = 1.
PDL_MAX_K = 4096
PDL_MAX_K_PAIRS = 16384
PDL_PAIR_LEVELS = (4, 8, 16)  # the codebook sizes PDL_MAX_K_PAIRS applies to


# MoE experts (`moe.moe_experts`)
# Most (token, slot) pairs served by the pair GEMV path.
PAIR_MAX_ROWS = 64

# Largest scratch buffer of decoded expert weights at prefill (bytes; `TURBOQUANT_MOE_SCRATCH_MB`): the routed
# experts are decoded in chunks that fit (at least one expert at a time), or all at once with the routing on the
# device where every expert's largest matrix fits.
PREFILL_SCRATCH_BYTES = settings.moe_scratch_bytes()
# Prefill: rotate the activations and decode the experts in the rotated basis (True), or decode the experts with
# the rotation undone on the tensor cores and multiply the activations as they are (False).
PREFILL_ROTATED_BASIS = True
# Prefill: the routed experts decoded inside the grouped products (`routed_lut_mm`: no scratch buffer, no host
# synchronisation) for up to this many (token, slot) pairs; above it, decoded into the scratch buffer for
# `torch._grouped_mm` (`_grouped_decoded`). 0: never fused.
FUSED_MAX_PAIRS = 1 << 62


# Packed-weight GEMM (`gemm.gemm`; `gemm.routed_gemm` for the MoE grouped products), 16-bit activations: dense
# layers from GEMM_MIN_M to GEMM_MAX_M rows, for codebooks of GEMM_LEVELS entries and groups a multiple of
# GEMM_GROUP_MULTIPLE (every tier at G = 128 on an H100: it beats the tensor-core GEMV and dequantize + cuBLAS at
# 64 to 256 rows on every 8B shape, and loses to them at 32 on most and at 512 and more; G = 64 is not timed yet:
# benchmarks/GEMM.md); the MoE grouped products from ROUTED_GEMM_MIN_PAIRS routed (token, slot) pairs (every
# fused prefill past the pair path) up to ROUTED_GEMM_MAX_ROWS pairs an expert on average (the routed lookup
# product is faster above; timed on Qwen3.5/3.6's expert shape, benchmarks/GEMM.md). `TURBOQUANT_GEMM_MIN_M=N`
# serves every M from N, every group size it can, every number of pairs from N; 0 turns it off.
# GEMM_OPEN: what `TURBOQUANT_GEMM_MIN_M` opens besides the smallest M.
GEMM_OPEN = dict(GEMM_MAX_M=1 << 62, GEMM_GROUP_MULTIPLE=64, ROUTED_GEMM_MAX_ROWS=1 << 62)
_GEMM_ENV = settings.gemm_min_m()
GEMM_MIN_M = 33 if _GEMM_ENV is None else _GEMM_ENV
GEMM_MAX_M = 256 if _GEMM_ENV is None else GEMM_OPEN["GEMM_MAX_M"]
GEMM_LEVELS = (4, 8, 16)
GEMM_GROUP_MULTIPLE = 128 if _GEMM_ENV is None else GEMM_OPEN["GEMM_GROUP_MULTIPLE"]
ROUTED_GEMM_MIN_PAIRS = PAIR_MAX_ROWS + 1 if _GEMM_ENV is None else _GEMM_ENV
ROUTED_GEMM_MAX_ROWS = 32 if _GEMM_ENV is None else GEMM_OPEN["ROUTED_GEMM_MAX_ROWS"]
# (largest M, (BM, BN, SWAP, LANES, GROUP, num_warps, num_stages, largest split-K)) by bucket of M, the last bucket
# for any larger M.
GEMM_CONFIGS = (
    (16, (16, 64, True, False, 1, 4, 3, 8)),
    (64, (64, 64, True, True, 1, 4, 3, 8)),
    (256, (128, 64, True, True, 4, 4, 3, 1)),
    (1 << 62, (256, 128, True, True, 8, 8, 2, 1)),
)
# Largest split-K, the multiprocessors whose count the split aims to fill twice, and the per-tile counters kept
# (tiles past it run without split-K).
GEMM_MAX_SPLIT = 8
# The packed words and norms of the next block of inputs loaded before the current block is decoded.
GEMM_PREFETCH = True
GEMM_SMS = 132
GEMM_COUNTERS = 1 << 16
