"""The rotation of the activations and the whole op at 16 to 2048 rows, by rotation kernel: the butterflies in
registers (`_rotate_rows_kernel`, `tuning.ROWS_MAX_M` raised) against the tensor-core rotation with 16, 32 or 64
rows a program (`tuning.ROTATE_BM`); CUDA-graph replays, bf16 `F.linear` in the same run.

    python profile_rotate.py
"""

from __future__ import annotations

import bench_linear as B
import torch
import torch.nn.functional as F
from turboquant_hf.kernels import linear as L
from turboquant_hf.kernels import tuning as T

from turboquant_hf.format import constants as fmt

VARIANTS = (("rows", 1 << 30, 0), ("mma16", 0, 16), ("mma32", 0, 32), ("mma64", 0, 64))


def main() -> int:
    g = 128
    s1, s2 = fmt.signs(g, "cuda")
    for k in (4096, 14336):
        for m in (16, 32, 64, 128, 256, 512, 2048):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = L.rotate(x, s1, s2, g, torch.bfloat16)
            cells = []
            for name, rows_max, bm in VARIANTS:
                T.ROWS_MAX_M, T.ROTATE_BM = rows_max, bm
                y = L.rotate(x, s1, s2, g, torch.bfloat16)
                err = B.rel_err(y, ref)
                t, _ = B.time_calls([lambda: L.rotate(x, s1, s2, g, torch.bfloat16)], graph=True)
                cells.append(f"{name} {t:.1f} us" + ("" if err < 1e-2 else f" (err {err:.1e})"))
            T.ROWS_MAX_M, T.ROTATE_BM = 16, 0
            print(f"rotate K={k} M={m}: " + ", ".join(cells), flush=True)
    for label, k, n in B.SHAPES[:3] + [B.SHAPES[4]]:
        case = B.Case(k, n, 3)
        for m in (32, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, bw = case.buffers(m)
            t_b, _ = B.time_calls([lambda w=w: F.linear(x, w) for w in bw], graph=True)
            cells = []
            for name, rows_max, bm in (("default", 16, 0),) + VARIANTS:
                T.ROWS_MAX_M, T.ROTATE_BM = rows_max, bm
                t, _ = B.time_calls([lambda pk=pk, nr=nr: torch.ops.turboquant.linear(
                    x, pk, nr, case.cb_ours, case.s1, case.s2, case.g, k) for pk, nr in q], graph=True)
                cells.append(f"{name} {t:.1f} ({t_b / t:.2f}x)")
            T.ROWS_MAX_M, T.ROTATE_BM = 16, 0
            print(f"op 3-bit {label} M={m} [{L.path(m, case.cb_ours.numel(), g, torch.bfloat16, case.ours)}]: "
                  f"bf16 {t_b:.1f} us; " + ", ".join(cells), flush=True)
            del q, bw
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
