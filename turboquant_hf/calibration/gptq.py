"""Calibrated rounding of one weight into tq3_native packed indices and norms (error feedback in the rotated basis).

A tq3_native group x (G weights of a row, zero-padded along the input) is stored as a norm s and indices idx and read
back as `x_hat = s * R^T c[idx]` with the orthogonal `R = D2 H D1 / sqrt(G)`. Any indices and any norms make a valid
tensor. With the layer's input Hessian `Hx = sum X^T X`, a row's output error on the calibration inputs is
`(w - w_hat) Hx (w - w_hat)^T`; in the rotated basis (`Rb = diag(R, ..., R)`) it is
`(w_rot - w_hat_rot) H (w_rot - w_hat_rot)^T` with `H = Rb Hx Rb^T`, and there the reconstruction of group g is simply
`s_g * c[idx]`. `gptq_rotated` therefore:

1. sweeps the rotated coordinates in order with OPTQ-style error feedback (the upper Cholesky factor of the damped
   inverse Hessian; the updates of later columns applied lazily, a block at a time): the grid of group g is
   `s_g * codebook` with `s_g` the norm of the group's error-updated coordinates when the sweep enters it, and each
   coordinate takes the index of its nearest codebook value by the round-to-nearest rule (the number of codebook
   boundaries strictly below `w / s_g`);
2. fits the norms of each row, indices fixed, by Hessian-weighted least squares (`A s = b` with
   `A[g, h] = v_g^T H v_h` and `b_g = v_g^T H w_rot`, `v_g` the codebook values of group g in its coordinates). A
   group keeps its sweep norm where the fitted one is not finite or not positive, and a row keeps all its sweep norms
   where the fit does not lower its error under the undamped Hessian.

Where a group receives no error feedback in a first sweep (the first group, or every group under a diagonal Hessian) its
coordinates and norm are the round-to-nearest quantizer's own (`codec.GroupQuantizer.rotate`), so its indices are
round-to-nearest's bit for bit.
"""

from __future__ import annotations

import math

import torch

from ..format import codec
from ..format import constants as fmt

# Settings of the rounding (`CalibrationConfig.options`): `sweeps` > 1 repeats the sweep with each group's grid scaled by
# the norms the previous one fitted, and fits them again; `block_size` columns are rounded between updates of the
# rest. The defaults and the orders not offered: benchmarks/QUALITY.md ("Rounding sweeps").
ROUNDING_OPTIONS = {"sweeps": 1, "block_size": 128}


def block_rotation(group_size: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """The matrix R (G x G) of the per-group rotation: `R @ x` equals `codec.rotate_groups(x)` for a group x."""
    s1, s2 = fmt.signs(group_size)
    h = codec.hadamard_matrix(group_size).to(torch.float64)
    r = s2.double()[:, None] * h * s1.double()[None, :] / math.sqrt(group_size)
    return r.to(device=device, dtype=dtype)


def rotate_hessian(hessian: torch.Tensor, group_size: int) -> torch.Tensor:
    """`Rb Hx Rb^T` (float64) for an input Hessian `Hx` (in x in), zero-padded to whole groups."""
    n = hessian.shape[0]
    padded = fmt.padded_width(n, group_size)
    h = torch.zeros(padded, padded, dtype=torch.float64, device=hessian.device)
    h[:n, :n] = hessian.to(torch.float64)
    r = block_rotation(group_size, torch.float64, hessian.device)
    groups = padded // group_size
    h = (h.view(padded, groups, group_size) @ r.t()).view(padded, padded)  # Hx Rb^T
    h = (h.t().contiguous().view(padded, groups, group_size) @ r.t()).view(padded, padded)  # Rb Hx Rb^T
    return (h + h.t()) / 2


def prepare_hessian(hessian: torch.Tensor, in_features: int) -> torch.Tensor:
    """The input Hessian as the rounding uses it (float64): an input that never fired (zero diagonal) weighs as much
    as an average live input, so its weights are still reproduced; with no live input at all, the identity."""
    if hessian.shape != (in_features, in_features):
        raise ValueError(f"Hessian of shape {tuple(hessian.shape)} does not match a weight with {in_features} inputs")
    h = hessian.to(torch.float64).clone()
    if not bool(torch.isfinite(h).all()):
        raise ValueError("the input Hessian holds NaN or Inf (the calibration activations overflowed)")
    diag = torch.diagonal(h)
    dead = diag <= 0
    if bool(dead.all()):
        return torch.eye(in_features, dtype=torch.float64, device=h.device)
    if bool(dead.any()):
        h[dead, :] = 0
        h[:, dead] = 0
        diag[dead] = diag[~dead].mean()
    return h


def _inverse_cholesky(h: torch.Tensor, damping: float) -> tuple[torch.Tensor, float]:
    """(U, lambda): the upper Cholesky factor of `(H + lambda I)^-1` with `lambda = damping * mean(diag H)`, raised
    tenfold until the factorization succeeds."""
    mean = float(torch.diagonal(h).mean())
    damping = max(damping, 1e-8)
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(8):
        lam = damping * mean
        chol, info = torch.linalg.cholesky_ex(h + lam * eye)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper, lam
        damping *= 10
    raise ValueError("the input Hessian could not be factorized even with strong damping")


def _unit_scaled(h: torch.Tensor) -> torch.Tensor:
    """`h` times the power of four that brings its mean diagonal near 1. The rounding depends on the Hessian only up
    to a factor, and a power of four changes no bit of it (every step scales exactly, square roots included), while
    the float32 factor of a Hessian of extreme scale (1e100 or 1e-100) would underflow or overflow into NaN norms."""
    mean = float(torch.diagonal(h).mean())
    if not math.isfinite(mean) or mean <= 0:
        return h
    return h * 4.0 ** -round(math.log2(mean) / 2)


class _Grid:
    """Codebook, boundaries and round-to-nearest's own rotation of the weight for one bit width and group size."""

    def __init__(self, bits, group_size: int, device):
        self.n_levels = fmt.levels_for_bits(bits)
        self.group_size = group_size
        self.codebook = fmt.codebook(self.n_levels, group_size, device)
        self.boundaries = fmt.boundaries(self.n_levels, group_size, device)

    def rotated(self, weight: torch.Tensor, bits) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, n): unit rotated groups `(rows, P)` and group norms `(rows, n_groups)` as round-to-nearest computes
        them (float32)."""
        rows, in_features = weight.shape
        g = self.group_size
        padded = fmt.padded_width(in_features, g)
        w = torch.zeros(rows, padded, dtype=torch.float32, device=weight.device)
        w[:, :in_features] = weight
        y, n = codec.group_quantizer(bits, g, weight.device).rotate(w.view(-1, g))
        return y.reshape(rows, padded), n.reshape(rows, padded // g)

    def index(self, y: torch.Tensor) -> torch.Tensor:
        """Round-to-nearest: the number of boundaries strictly below each value."""
        return torch.searchsorted(self.boundaries, y.contiguous())


class _OneThreadOnCPU:
    """Runs the sweep with one torch thread on CPU: its thousands of small operations per weight gain nothing from
    intra-op threads, and each one's fork and join waits for the slowest thread (milliseconds a call when another
    process holds a core)."""

    def __init__(self, device: torch.device):
        self.active = device.type == "cpu" and torch.get_num_threads() > 1

    def __enter__(self):
        if self.active:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.active:
            torch.set_num_threads(self.threads)


def _sweep(w: torch.Tensor, upper: torch.Tensor, grid: _Grid, y0: torch.Tensor, n0: torch.Tensor,
           scales: torch.Tensor | None, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One error-feedback sweep over the rotated coordinates of `w` (rows, P), updated in place. Returns the indices
    (rows, P) int64 and the grid scales (rows, n_groups). `scales`: fixed grid scales instead of the entry norms."""
    rows, padded = w.shape
    g = grid.group_size
    block_size = max(g, block_size // g * g)
    index = torch.empty(rows, padded, dtype=torch.int64, device=w.device)
    used = torch.empty(rows, padded // g, dtype=torch.float32, device=w.device)
    codebook = grid.codebook
    for b0 in range(0, padded, block_size):
        b1 = min(padded, b0 + block_size)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        u1 = upper[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % g == 0:
                k = col // g
                group = w1[:, j:j + g]
                # untouched groups take round-to-nearest's norm and unit coordinates (bit-exact indices)
                untouched = (group == y0[:, col:col + g] * n0[:, k:k + 1]).all(1)
                s = torch.linalg.vector_norm(group, dim=1) if scales is None else scales[:, k].clone()
                if scales is None:
                    s = torch.where(untouched, n0[:, k], s)
                else:
                    untouched &= s == n0[:, k]
                used[:, k] = s
                inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), 0.0)
            x = w1[:, j]
            y = x * inv
            y = torch.where(untouched & (x == y0[:, col] * n0[:, k]), y0[:, col], y)
            idx = grid.index(y)
            index[:, col] = idx
            q = codebook[idx] * s
            e = (x - q) / u1[j, j]
            if j + 1 < b1 - b0:
                w1[:, j + 1:].addr_(e, u1[j, j + 1:], alpha=-1)
            err1[:, j] = e
        if b1 < padded:
            w[:, b1:].addmm_(err1, upper[b0:b1, b1:], alpha=-1)
    return index, used


def _fit_norms(w_rot: torch.Tensor, values: torch.Tensor, h: torch.Tensor, lam: float, sweep_norms: torch.Tensor,
               group_size: int, chunk: int = 256) -> torch.Tensor:
    """Norms fitted by Hessian-weighted least squares per row, indices fixed (see the module docstring)."""
    rows, padded = w_rot.shape
    ng = padded // group_size
    hg = h.view(padded, ng, group_size)
    out = sweep_norms.clone()
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        v = values[r0:r1].double().view(-1, ng, group_size)
        wr = w_rot[r0:r1].double()
        hv = torch.einsum("phk,rhk->rph", hg, v)  # H v_h for every h
        a = torch.einsum("rgk,rgkh->rgh", v, hv.view(-1, ng, group_size, ng))
        b = (v * (wr @ h).view(-1, ng, group_size)).sum(-1)
        vv = (v * v).sum(-1)
        vw = (v * wr.view(-1, ng, group_size)).sum(-1)
        a_damped = a + torch.diag_embed(lam * vv + (vv == 0).double())
        fitted, _ = torch.linalg.solve_ex(a_damped, (b + lam * vw).unsqueeze(-1))
        fitted = fitted.squeeze(-1)
        sweep = sweep_norms[r0:r1].double()
        fitted = torch.where(torch.isfinite(fitted) & (fitted > 0), fitted, sweep)

        better = _objective(fitted, a, b) <= _objective(sweep, a, b)
        out[r0:r1] = torch.where(better[:, None], fitted, sweep).float()
    return out


def _objective(s: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, `s^T A s - 2 b^T s`: the weighted error of norms `s` up to a constant of the row."""
    return (s.unsqueeze(1) @ a @ s.unsqueeze(2)).view(-1) - 2 * (b * s).sum(-1)


def gptq_rotated(weight: torch.Tensor, hessian: torch.Tensor, bits=3, group_size: int = 128, damping: float = 0.01,
                 sweeps: int = 1, block_size: int = 128, fit_norms: bool = True,
                 name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `weight` (out, in) with error feedback against the input Hessian `hessian` (in, in; `sum X^T X` of
    the layer's inputs): packed uint8 `(out*n_groups, bytes_per_group)` and norms float32 `(out, n_groups)`, the
    layout `codec.quantize_weight` returns (see the module docstring for the method). `sweeps`: see
    `ROUNDING_OPTIONS`. `fit_norms=False` skips the last least-squares fit: the norms are the last sweep's grid
    scales."""
    n_levels = fmt.levels_for_bits(bits)
    group_size = fmt.check_group_size(group_size)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"{name}: expected a 2-D floating-point weight, got {weight.dtype} {tuple(weight.shape)}")
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{name}: weight contains NaN or Inf; refusing to quantize it")
    if isinstance(sweeps, bool) or not isinstance(sweeps, int) or sweeps < 1:
        raise ValueError(f"{name}: sweeps must be a positive integer, got {sweeps!r}")
    rows, in_features = weight.shape
    device = weight.device
    grid = _Grid(bits, group_size, device)
    h = _unit_scaled(rotate_hessian(prepare_hessian(hessian.to(device), in_features), group_size))
    upper64, lam = _inverse_cholesky(h, damping)
    y0, n0 = grid.rotated(weight, bits)
    padded, ng = y0.shape[1], n0.shape[1]
    upper = upper64.float()
    w_rot = (y0.view(rows, ng, group_size) * n0.unsqueeze(-1)).view(rows, padded)
    scales = None
    for sweep in range(sweeps):
        with _OneThreadOnCPU(device):
            index, used = _sweep(w_rot.clone(), upper, grid, y0, n0, scales, block_size)
        values = grid.codebook[index]
        last = sweep == sweeps - 1
        scales = used if last and not fit_norms else _fit_norms(w_rot, values, h, lam, used, group_size)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"{name}: the calibrated rounding produced non-finite norms; quantize it to nearest instead")
    packed = codec.pack_indices(index.view(rows * ng, group_size), n_levels)
    return packed, scales


def weighted_error(weight: torch.Tensor, hessian: torch.Tensor, packed: torch.Tensor, norms: torch.Tensor,
                   group_size: int) -> float:
    """`sum over rows of (w - w_hat) Hx (w - w_hat)^T`: the squared output error of the quantized weight on the
    calibration inputs whose Hessian is `hessian`."""
    in_features = weight.shape[1]
    w_hat = codec.dequantize_weight(packed, norms.float(), in_features, group_size).double()
    d = weight.double() - w_hat
    return float(((d @ hessian.double()) * d).sum())
