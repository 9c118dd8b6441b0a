"""The TurboQuant codec in plain torch: rotation, Lloyd-Max rounding, packing.

No transformers import. Tensor layout follows the tq3_native format: a weight
`W[..., out, in]` is flattened to `(rows, in)`, zero-padded on the right to a
multiple of G, and split into groups of G along the input dimension.

Quantization (`quantize_weight`, and the streaming converter through the same
`GroupQuantizer`) runs on whatever device the weight is on, as a fixed
sequence of IEEE float32 elementwise operations: group norms by a pairwise
tree, the Walsh-Hadamard rotation by butterfly stages, rounding by counting
codebook boundaries. No matrix product and no library reduction takes part, so
the packed bytes and norms are the same on every device, with any number of
threads and however the rows are split. `rotate_groups` / `unrotate_groups`
(matrix products) serve the activations and the dequantization, which need no
bit-exactness.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from typing import ClassVar

import torch

from . import constants as fmt


@lru_cache(maxsize=None)
def _hadamard_pm1_cpu(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


_DEVICE_CACHE: dict = {}


def hadamard_matrix(n: int, device=None) -> torch.Tensor:
    """Sylvester Walsh-Hadamard matrix of order n with +-1 entries (not normalised)."""
    key = ("hadamard", n, str(torch.device(device) if device is not None else "cpu"))
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = _hadamard_pm1_cpu(n).to(device)
    return _DEVICE_CACHE[key]


def rotate_groups(x: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor) -> torch.Tensor:
    """Apply y = D2 . H . D1 . x to every group (the last dim, of size G) of float32 `x`."""
    g = x.shape[-1]
    h = hadamard_matrix(g, x.device)
    return ((x * signs1) @ h) / math.sqrt(g) * signs2


def unrotate_groups(y: torch.Tensor, signs1: torch.Tensor, signs2: torch.Tensor) -> torch.Tensor:
    """Inverse of `rotate_groups`: x = D1 . H . D2 . y."""
    g = y.shape[-1]
    h = hadamard_matrix(g, y.device)
    return ((y * signs2) @ h) / math.sqrt(g) * signs1


# ---------------------------------------------------------------------------
# packing: LSB-first bit stream per group (2/3/4 bits), base-3 digits for ternary
# ---------------------------------------------------------------------------

def _pack_unit(n_levels: int) -> tuple[int, int, int]:
    """(bits per index, indices per unit, bytes per unit) for whole-byte units of the bit stream."""
    b = int(math.log2(n_levels))
    per_unit = 8 // math.gcd(b, 8)
    return b, per_unit, per_unit * b // 8


def pack_indices(indices: torch.Tensor, n_levels: int) -> torch.Tensor:
    """Pack `(n, G)` integer indices into `(n, bytes_per_group)` uint8."""
    n, g = indices.shape
    if n_levels == 3:
        width = -(-g // 5) * 5
        trits = torch.zeros(n, width, dtype=torch.int32, device=indices.device)
        trits[:, :g] = indices
        weights = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=indices.device)
        return (trits.view(n, -1, 5) * weights).sum(-1).to(torch.uint8)
    b, per_unit, unit_bytes = _pack_unit(n_levels)
    idx = indices.to(torch.int32).view(n, g // per_unit, per_unit)
    shifts = torch.arange(per_unit, dtype=torch.int32, device=indices.device) * b
    words = (idx << shifts).sum(-1)  # at most 24 bits: fits int32
    byte_shifts = torch.arange(unit_bytes, dtype=torch.int32, device=indices.device) * 8
    out = (words.unsqueeze(-1) >> byte_shifts) & 0xFF
    return out.to(torch.uint8).view(n, -1)


def unpack_indices(packed: torch.Tensor, n_levels: int, group_size: int) -> torch.Tensor:
    """Inverse of `pack_indices`: `(n, bytes_per_group)` uint8 to `(n, G)` int64."""
    n = packed.shape[0]
    if n_levels == 3:
        powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.int32, device=packed.device)
        digits = (packed.to(torch.int32).unsqueeze(-1) // powers) % 3
        return digits.view(n, -1)[:, :group_size].long()
    b, per_unit, unit_bytes = _pack_unit(n_levels)
    units = packed.to(torch.int32).view(n, -1, unit_bytes)
    byte_shifts = torch.arange(unit_bytes, dtype=torch.int32, device=packed.device) * 8
    words = (units << byte_shifts).sum(-1)
    shifts = torch.arange(per_unit, dtype=torch.int32, device=packed.device) * b
    return ((words.unsqueeze(-1) >> shifts) & (n_levels - 1)).view(n, group_size).long()


def _chunk_code_table(n_levels: int, device) -> torch.Tensor:
    """Indices decoded from every possible chunk code: (codes, indices per chunk), int64.

    Chunks are whole bytes for 2/4 bits and ternary, and 12-bit halves of each 3-byte unit for 3 bits,
    so that one table lookup decodes several indices at once.
    """
    key = ("chunk_codes", n_levels, str(torch.device(device) if device is not None else "cpu"))
    if key not in _DEVICE_CACHE:
        if n_levels == 3:
            codes = torch.arange(243)
            table = torch.stack([(codes // 3**i) % 3 for i in range(5)], -1)
        else:
            b = int(math.log2(n_levels))
            chunk_bits = 12 if b == 3 else 8
            codes = torch.arange(2**chunk_bits)
            table = torch.stack([(codes >> (b * i)) & (n_levels - 1) for i in range(chunk_bits // b)], -1)
        _DEVICE_CACHE[key] = table.to(device)
    return _DEVICE_CACHE[key]


def decode_values(packed: torch.Tensor, codebook: torch.Tensor, group_size: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """`codebook[idx]` for packed groups `(n, bytes_per_group)`: float `(n, G)`, via one table lookup per chunk
    (`index_select` on the table's rows: on CPU several times faster than indexing it with a tensor). `out`: a
    contiguous `(n, G)` tensor of the codebook's dtype to write into where the chunks tile the groups exactly
    (not ternary, whose groups end in padding digits); otherwise a new tensor is returned."""
    n_levels = codebook.numel()
    lut = codebook[_chunk_code_table(n_levels, packed.device)]  # (codes, indices per chunk)
    n = packed.shape[0]
    if n_levels == 8:
        units = packed.view(n, -1, 3)
        if sys.byteorder == "little":  # each 3-byte unit read as the low bytes of a 32-bit word
            word = torch.nn.functional.pad(units, (0, 1)).view(torch.int32).squeeze(-1)
        else:
            u = units.to(torch.int32)
            word = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16)
        codes = torch.stack([word & 0xFFF, word >> 12], -1).view(-1)
    else:
        codes = packed.reshape(-1).to(torch.int32)
    per = lut.shape[1]
    if out is not None and codes.numel() * per == n * group_size:
        return torch.index_select(lut, 0, codes, out=out.view(-1, per)).view(n, group_size)
    return lut.index_select(0, codes).view(n, -1)[:, :group_size]


# ---------------------------------------------------------------------------
# the quantizer: a fixed sequence of float32 elementwise operations
# ---------------------------------------------------------------------------

# Rows per chunk keep the temporaries of a large tensor to a few hundred MB.
_CHUNK_ELEMENTS = 1 << 24
# Weights per block of groups that the quantizer works on at once on CPU: its buffers (19 bytes a weight) stay in
# the caches. On other devices a block holds up to _CHUNK_ELEMENTS weights.
_CPU_BLOCK_ELEMENTS = 1 << 18
# Groups whose sum of squares falls outside [_SMALLEST_SUM, inf) are scaled by a power of two first.
_SMALLEST_SUM = 2.0**-100
# Weights below which a CPU block is not split further to give every worker thread a share.
_CPU_MIN_SPLIT_ELEMENTS = 1 << 15


class _CPUWorkers:
    """Threads that quantize CPU blocks with one torch thread each, for callers with several torch threads.

    A block is some 70 small elementwise operations. Left to torch's intra-op threads, each of them is a fork and
    join of the OpenMP team, and the join waits for any of its threads that another process has taken the core
    from: a scheduler time slice (several ms) at a large share of the operations on a busy machine, seconds per
    weight. Whole blocks on single-threaded workers wait at most once per call. Each worker keeps its own buffers
    (`GroupQuantizer._storage`)."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _shared: ClassVar[dict] = {}  # number of workers -> _CPUWorkers
    _pid: ClassVar[int | None] = None  # the process whose threads _shared holds

    def __init__(self, n: int):
        self.n = n
        # torch.set_num_threads(1) in the workers also sets the count that threads started later begin with:
        # read that count first, and set it back afterwards from a thread of its own (the caller's is left alone)
        with ThreadPoolExecutor(1) as probe:
            default = probe.submit(torch.get_num_threads).result()
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="turboquant-quantize")
        ready = threading.Barrier(n + 1)
        for _ in range(n):  # every thread started and single-threaded before the first block
            self.pool.submit(self._single_threaded, ready)
        ready.wait()
        with ThreadPoolExecutor(1) as restore:
            restore.submit(torch.set_num_threads, default).result()

    @staticmethod
    def _single_threaded(ready: threading.Barrier) -> None:
        torch.set_num_threads(1)
        ready.wait()

    @classmethod
    def get(cls, n: int) -> _CPUWorkers:
        """The shared workers, `n` of them (made again in a forked child, which has none of the threads)."""
        with cls._lock:
            if cls._pid != os.getpid():
                cls._shared, cls._pid = {}, os.getpid()
            if n not in cls._shared:
                cls._shared[n] = cls(n)
            return cls._shared[n]

    def run(self, fn, spans) -> None:
        """fn(start, stop) for every span; once all are done, the error of the first span that failed is raised."""
        futures = [self.pool.submit(fn, a, b) for a, b in spans]
        try:
            wait(futures)
        except BaseException:  # interrupted: drop the blocks not started
            for f in futures:
                f.cancel()
            raise
        for f in futures:
            f.result()


def _halves(g: int) -> list[int]:
    """G/2, G/4, ..., 1: the widths of the pairwise tree's levels."""
    return [g >> k for k in range(1, g.bit_length())]


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root of float32 `t`, on every device.

    torch's float32 sqrt on CPU is not correctly rounded (it differs from IEEE in the last bit for about one value
    in six); the float64 square root rounded to float32 is, because the square root of a float32 value is never
    within 2**-50 (relative) of a point halfway between two float32 values, and the float64 result is far closer.
    """
    return t.double().sqrt_().float()


def _powers_of_two(e: torch.Tensor) -> torch.Tensor:
    """2**e in float32 for integers e in [-126, 127], from the exponent bits: exact on every device."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


class GroupQuantizer:
    """Quantizes rows of a weight to packed indices and group norms, with bytes that depend on the weight alone:
    not on the device, the number of threads, or how the rows are split between calls.

    Every step is an IEEE float32 elementwise operation (correctly rounded on CPU and CUDA alike) in a fixed
    order; there is no matrix product and no reduction whose summation order a library or a kernel would choose.
    For each group x of G weights (G a power of two):

    1. the sum of squares by a fixed pairwise tree: the G squares, then log2(G) times the upper half added to the
       lower half (s[j] + s[j + w], w = G/2, G/4, ..., 1); the norm n is its correctly rounded square root;
    2. the unit vector u = (s1 * x) / n (the sign flip of D1 is exact);
    3. the Walsh-Hadamard transform H u in log2(G) butterfly stages h = 1, 2, 4, ..., G/2: in every block of 2h
       coordinates the pair (i, i + h) becomes (a + b, a - b);
    4. y = (H u) / (s2 * sqrt(G)), one correctly rounded division (the sign of D2 is again exact), so that
       y = D2 . H . D1 . x / (n sqrt(G)) up to the rounding of these steps;
    5. the index of each coordinate: the number of codebook boundaries strictly below y
       (= searchsorted(boundaries, y));
    6. the stored norm n / r, where r is the square root of the same tree over the squares of the chosen
       centroids (the rotation is orthogonal, so r is the norm of the reconstruction before scaling).

    A group whose sum of squares would overflow float32 or fall below 2**-100 is first multiplied by a power of
    two (exact), so that its indices are those of the same group at an ordinary scale and its norm the matching
    power-of-two multiple. NaN and Inf are refused, naming the tensor, the row and the column.

    The groups of a block sit one per column of `(G, groups)` buffers, so that every step (the tree's levels,
    the butterflies, the comparisons, the packing) runs along contiguous memory; on CPU the blocks are sized for
    the caches, each runs single-threaded (on the shared `_CPUWorkers` where the caller has several torch
    threads), and each thread keeps its buffers and their views from one call to the next.
    """

    def __init__(self, bits, group_size: int, device=None):
        self.n_levels = fmt.levels_for_bits(bits)
        self.group_size = g = fmt.check_group_size(group_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        s1, s2 = fmt.signs(g)
        self.signs1 = s1.view(g, 1).to(self.device)
        # s2 * sqrt(G), the float32 square root of G with the sign of D2: dividing by it is one rounding
        self.divisor = (s2 * torch.tensor(float(g)).sqrt()).view(g, 1).to(self.device)
        centroids = fmt.codebook(self.n_levels, g)
        self.boundaries = ((centroids[:-1] + centroids[1:]) / 2).tolist()  # float32 values, exactly
        # the first level of the tree over the squared centroids, looked up by pairs of indices:
        # pair_sums[i * L + j] = c[i]**2 + c[j]**2, the float32 sum that the tree itself would compute
        squares = centroids * centroids
        self.pair_sums = (squares.unsqueeze(1) + squares.unsqueeze(0)).view(-1).to(self.device)
        self.bytes_per_group = fmt.bytes_per_group(self.n_levels, g)
        # rows of the index buffer: G, and for ternary the zero digits that complete the last byte
        self.index_rows = self.bytes_per_group * 5 if self.n_levels == 3 else g
        self._local = threading.local()

    def __call__(self, x: torch.Tensor, name: str = "weight", first_row: int = 0, out=None):
        """Quantize `(rows, in_features)` floating-point rows on this quantizer's device: packed uint8
        `(rows * n_groups, bytes_per_group)` and norms float32 `(rows, n_groups)`, written into `out` (that pair
        of tensors) when given. `name` and `first_row` (the row of `x[0]` in the whole tensor) name a NaN or
        Inf in the error."""
        g = self.group_size
        rows, in_features = x.shape
        n_groups = -(-in_features // g)
        padded = x if n_groups * g == in_features else torch.nn.functional.pad(x, (0, n_groups * g - in_features))
        groups = padded.reshape(-1, g)
        total = groups.shape[0]
        if out is None:
            out = (torch.empty(total, self.bytes_per_group, dtype=torch.uint8, device=x.device),
                   torch.empty(rows, n_groups, dtype=torch.float32, device=x.device))
        packed, norms = out
        if not total:
            return packed, norms
        flat_norms = norms.view(-1)
        source = (x, name, first_row)
        if self.device.type != "cpu":
            block = max(1, _CHUNK_ELEMENTS // g)
            storage = self._storage(min(total, block))
            for start in range(0, total, block):
                stop = min(total, start + block)
                self._block(self._views(storage, stop - start), groups[start:stop], packed[start:stop],
                            flat_norms[start:stop], source)
            return packed, norms
        # CPU: blocks of equal size within the cache budget, rounded up to a multiple of the worker threads while
        # they stay above the smallest size worth splitting
        threads = torch.get_num_threads()
        n_blocks = -(-total // max(1, _CPU_BLOCK_ELEMENTS // g))
        if threads > 1:
            n_blocks = max(n_blocks, min(-(-n_blocks // threads) * threads, total * g // _CPU_MIN_SPLIT_ELEMENTS))
        block = -(-total // n_blocks)

        def run(start: int, stop: int) -> None:
            self._block(self._views(self._storage(block), stop - start), groups[start:stop], packed[start:stop],
                        flat_norms[start:stop], source)

        spans = [(start, min(total, start + block)) for start in range(0, total, block)]
        if threads == 1:  # already single-threaded (as the converter's workers are): here, in order
            for start, stop in spans:
                run(start, stop)
        else:
            _CPUWorkers.get(threads).run(run, spans)
        return packed, norms

    def rotate(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, n) for float32 groups `(k, G)`: the rotated unit vectors `(k, G)` (steps 1 to 4) and the norms
        `(k,)`, computed as the quantizer computes them (without the scaling of out-of-range groups)."""
        k = groups.shape[0]
        v = self._views(self._storage(k), k)
        n = _sqrt(self._load(v, groups))
        v["a"].div_(torch.where(n > 0, n, 1.0))
        return self._rotate(v).t().clone(), n.clone()

    # -- buffers -------------------------------------------------------------------------------------------------
    def _storage(self, groups: int) -> dict:
        """Flat buffers for blocks of up to `groups` groups: this thread's own on CPU (kept), new ones elsewhere."""
        cpu = self.device.type == "cpu"
        cached = getattr(self._local, "storage", None) if cpu else None
        if cached is not None and cached["groups"] >= groups:
            return cached
        g, dev = self.group_size, self.device
        storage = {"groups": groups, "views": {},
                   "a": torch.empty(g * groups, device=dev), "b": torch.empty(g * groups, device=dev),
                   "c": torch.empty(g * groups, device=dev),
                   "index": torch.empty(self.index_rows * groups, dtype=torch.uint8, device=dev),
                   "gather": torch.empty(g * groups, dtype=torch.int32, device=dev),
                   "staging": torch.empty(g * groups, dtype=torch.int16, device=dev)}
        if cpu:
            self._local.storage = storage
        return storage

    def _views(self, storage: dict, cols: int) -> dict:
        """The views that the steps of a block of `cols` groups read and write, made once for each block width."""
        views = storage["views"]
        if cols not in views:
            if len(views) >= 8:  # a few widths recur: full blocks, and the last block of each shape
                views.clear()
            g = self.group_size
            a, b, c = (storage[k][: g * cols].view(g, cols) for k in "abc")
            gather = storage["gather"][: g * cols]
            half = g * cols // 2
            v = {"a": a, "b": b, "c": c, "gather": gather,
                 "gather_halves": (gather[:half].view(g // 2, cols), gather[half:].view(g // 2, cols)),
                 # int32 pair indices in c, and their looked-up sums straight into the tree's first level in b
                 "pairs": c.view(-1)[:half].view(torch.int32),
                 "first_level": b.view(-1)[:half],
                 "staging": storage["staging"][: g * cols].view(g, cols),
                 "index": storage["index"][: self.index_rows * cols].view(self.index_rows, cols),
                 # the pairwise tree, in place in b: rows [0, w) += rows [w, 2w)
                 "tree": [(b[:w], b[w:2 * w]) for w in _halves(g)]}
            # the butterfly stages, from a to b, then b to a, ...: the lower and upper halves of each block of 2h
            stages, src, dst, h = [], a, b, 1
            while h < g:
                s, d = src.view(g // (2 * h), 2, h * cols), dst.view(g // (2 * h), 2, h * cols)
                stages.append((s[:, 0], s[:, 1], d[:, 0], d[:, 1]))
                src, dst, h = dst, src, 2 * h
            v["stages"], v["rotated"], v["free"] = stages, src, dst
            views[cols] = v
        return views[cols]

    # -- the steps -----------------------------------------------------------------------------------------------
    def _load(self, v: dict, groups: torch.Tensor) -> torch.Tensor:
        """Groups `(cols, G)` into `a` as s1 * x in float32, one group a column; their sums of squares `(cols,)`."""
        a, b = v["a"], v["b"]
        if groups.dtype == torch.float32:
            a.copy_(groups.t())  # a blocked transposing copy
            a.mul_(self.signs1)
        elif groups.element_size() == 2:  # bfloat16, float16: transposed as 16-bit words, then widened
            staging = v["staging"].view(groups.dtype)
            staging.copy_(groups.t())
            torch.mul(staging, self.signs1, out=a)
        else:
            torch.mul(groups.t(), self.signs1, out=a)
        torch.mul(a, a, out=b)
        return self._tree(v)

    def _tree(self, v: dict, first_level: int = 0) -> torch.Tensor:
        """The pairwise-tree sum over the rows of `b`, in place (from `first_level` on): row 0 of `b`."""
        for lower, upper in v["tree"][first_level:]:
            torch.add(lower, upper, out=lower)
        return v["b"][0]

    def _rotate(self, v: dict) -> torch.Tensor:
        """The butterfly stages over the unit vectors in `a`, then the division by s2 * sqrt(G): `(G, cols)`."""
        for lower, upper, sums, differences in v["stages"]:
            torch.add(lower, upper, out=sums)
            torch.sub(lower, upper, out=differences)
        return v["rotated"].div_(self.divisor)

    def _block(self, v: dict, groups, packed, norms, source) -> None:
        sums = self._load(v, groups)
        lo, hi = torch.aminmax(sums)
        exponents = None
        if not bool((lo >= _SMALLEST_SUM) & (hi < math.inf)):  # NaN fails both
            exponents = self._scale_out_of_range(v, sums, source)
        n = _sqrt(sums)
        v["a"].div_(torch.where(n > 0, n, 1.0))
        y = self._rotate(v)
        # the index: boundaries strictly below y, counted in float32 (exact small integers)
        count, below = v["free"], v["c"]
        torch.gt(y, self.boundaries[0], out=count)
        for b in self.boundaries[1:]:
            count.add_(torch.gt(y, b, out=below))
        gather, index = v["gather"], v["index"]
        gather.copy_(count.view(-1))
        index[: self.group_size].copy_(gather.view(count.shape))
        if self.index_rows > self.group_size:
            index[self.group_size:].zero_()
        # the reconstruction norm: the same tree over the squared centroids, its first level by table lookup
        lower, upper = v["gather_halves"]
        pairs = v["pairs"]
        torch.add(upper, lower, alpha=self.n_levels, out=pairs.view(lower.shape))
        torch.index_select(self.pair_sums, 0, pairs, out=v["first_level"])
        r = _sqrt(self._tree(v, first_level=1))
        torch.div(n, torch.where(r > 0, r, 1.0), out=norms)
        if exponents is not None:
            half = torch.div(exponents, 2, rounding_mode="floor")
            norms.mul_(_powers_of_two(half)).mul_(_powers_of_two(exponents - half))
        packed.copy_(self._pack(index).t())

    def _scale_out_of_range(self, v: dict, sums: torch.Tensor, source) -> torch.Tensor:
        """Refuse NaN and Inf; multiply the groups whose sum of squares is out of range by 2**-e (e the exponent of
        their largest magnitude, so that it lands in [0.5, 1)), in two exact steps, and sum their squares again.
        Returns e for every group of the block (0 for the others)."""
        a = v["a"]
        if not bool(torch.isfinite(a).all()):
            x, name, first_row = source
            bad = (~torch.isfinite(x.to(torch.float32))).nonzero()[0]
            raise ValueError(
                f"{name}: weight contains NaN or Inf (first at row {first_row + int(bad[0])}, column {int(bad[1])}); "
                "refusing to quantize it"
            )
        cols = ((sums < _SMALLEST_SUM) | (sums == math.inf)).nonzero().squeeze(1)
        selected = a[:, cols]
        _, e = torch.frexp(selected.abs().amax(0))  # 0 for an all-zero group: left as it is
        half = torch.div(e, 2, rounding_mode="floor")
        a[:, cols] = selected.mul_(_powers_of_two(-half)).mul_(_powers_of_two(half - e))
        torch.mul(a, a, out=v["b"])
        self._tree(v)  # sums, in place
        exponents = torch.zeros(a.shape[1], dtype=torch.int32, device=a.device)
        exponents[cols] = e
        return exponents

    def _pack(self, index: torch.Tensor) -> torch.Tensor:
        """`(index_rows, cols)` uint8 indices, one group a column, to `(bytes_per_group, cols)` packed bytes: the
        LSB-first bit stream of 2/3/4-bit indices, or five base-3 digits a byte for ternary."""
        g, cols = self.group_size, index.shape[1]
        if self.n_levels == 16:
            v = index.view(g // 2, 2, cols)
            return v[:, 0] | (v[:, 1] << 4)
        if self.n_levels == 4:
            v = index.view(g // 4, 4, cols)
            out = v[:, 0] | (v[:, 1] << 2)
            out |= v[:, 2] << 4
            out |= v[:, 3] << 6
            return out
        if self.n_levels == 8:  # 8 indices, 3 bytes
            v = index.view(g // 8, 8, cols)
            out = torch.empty(g // 8, 3, cols, dtype=torch.uint8, device=index.device)
            torch.bitwise_or(v[:, 0], v[:, 1] << 3, out=out[:, 0])
            out[:, 0] |= v[:, 2] << 6
            torch.bitwise_or(v[:, 2] >> 2, v[:, 3] << 1, out=out[:, 1])
            out[:, 1] |= v[:, 4] << 4
            out[:, 1] |= v[:, 5] << 7
            torch.bitwise_or(v[:, 5] >> 1, v[:, 6] << 2, out=out[:, 2])
            out[:, 2] |= v[:, 7] << 5
            return out.view(-1, cols)
        v = index.view(self.bytes_per_group, 5, cols)  # ternary, least significant digit first
        out = v[:, 0] + v[:, 1] * 3
        out += v[:, 2] * 9
        out += v[:, 3] * 27
        out += v[:, 4] * 81
        return out


def group_quantizer(bits, group_size: int, device=None) -> GroupQuantizer:
    """The shared `GroupQuantizer` for these bits, group size and device."""
    n_levels = fmt.levels_for_bits(bits)
    key = ("quantizer", n_levels, group_size, str(torch.device(device) if device is not None else "cpu"))
    if key not in _DEVICE_CACHE:
        _DEVICE_CACHE[key] = GroupQuantizer(bits, group_size, device)
    return _DEVICE_CACHE[key]


# ---------------------------------------------------------------------------
# quantize / dequantize one weight tensor
# ---------------------------------------------------------------------------

def quantize_weight(
    weight: torch.Tensor,
    bits=3,
    group_size: int = 128,
    name: str = "weight",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `W[..., out, in]` to (packed uint8 `(rows*n_groups, bpg)`, norms float32 `(rows, n_groups)`).

    Runs on `weight.device` with `GroupQuantizer`'s float32 operations, so the bytes are the same on every
    device. Raises ValueError naming `name` if the weight holds NaN or Inf.
    """
    n_levels = fmt.levels_for_bits(bits)
    group_size = fmt.check_group_size(group_size)
    if weight.dim() < 2:
        raise ValueError(f"{name}: expected a weight of at least 2 dimensions, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point weight, got {weight.dtype}")
    in_features = weight.shape[-1]
    w2d = weight.reshape(-1, in_features)
    rows = w2d.shape[0]
    n_groups = -(-in_features // group_size)
    device = weight.device
    quantizer = group_quantizer(bits, group_size, device)
    packed = torch.empty(rows * n_groups, fmt.bytes_per_group(n_levels, group_size), dtype=torch.uint8, device=device)
    norms = torch.empty(rows, n_groups, dtype=torch.float32, device=device)
    chunk_rows = max(1, _CHUNK_ELEMENTS // (n_groups * group_size))
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        quantizer(w2d[start:stop], name, start,
                  out=(packed[start * n_groups : stop * n_groups], norms[start:stop]))
    return packed, norms


def dequantize_weight(
    packed: torch.Tensor,
    norms: torch.Tensor,
    in_features: int,
    group_size: int,
    shape: tuple | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rebuild the weight from packed indices and norms (float32 math, padding dropped)."""
    group_size = fmt.check_group_size(group_size)
    rows, n_groups = norms.shape
    n_levels = fmt.levels_from_geometry(packed.shape[1], group_size)
    device = packed.device
    s1, s2 = fmt.signs(group_size, device)
    centroids = fmt.codebook(n_levels, group_size, device)
    out = torch.empty(rows, in_features, dtype=dtype, device=device)
    chunk_rows = max(1, _CHUNK_ELEMENTS // (n_groups * group_size))
    for start in range(0, rows, chunk_rows):
        stop = min(rows, start + chunk_rows)
        values = decode_values(packed[start * n_groups : stop * n_groups], centroids, group_size)
        w = unrotate_groups(values, s1, s2) * norms[start:stop].reshape(-1, 1).float()
        out[start:stop] = w.view(stop - start, -1)[:, :in_features].to(dtype)
    return out.view(shape) if shape is not None else out


def rotated_weight(packed: torch.Tensor, norms: torch.Tensor, codebook: torch.Tensor, group_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight in the rotated basis, `(rows, n_groups*G)` float32: norm * codebook[idx] per group. `out`: a
    contiguous buffer of at least that many elements, of the codebook's dtype, to build it in (used where the
    codebook's and the norms' dtypes give that dtype; the result is then a view of `out`)."""
    rows, n_groups = norms.shape
    numel = rows * n_groups * group_size
    if out is not None and out.numel() >= numel and codebook.dtype == out.dtype \
            and torch.promote_types(codebook.dtype, norms.dtype) == out.dtype:
        w = out[:numel].view(rows, n_groups, group_size)
        if codebook.numel() != 3:  # the chunks tile a group: decoded straight into the buffer, scaled in place
            decode_values(packed, codebook, group_size, out=w.view(rows * n_groups, group_size))
            w.mul_(norms.unsqueeze(-1))
        else:  # (ternary groups end in padding digits)
            values = decode_values(packed, codebook, group_size)
            torch.mul(values.view(rows, n_groups, group_size), norms.unsqueeze(-1), out=w)
        return w.view(rows, -1)
    values = decode_values(packed, codebook, group_size)
    return (values.view(rows, n_groups, group_size) * norms.unsqueeze(-1)).view(rows, -1)


_SCRATCH = threading.local()


def decode_scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A CPU buffer of at least `numel` elements of `dtype`, kept per thread for the reference product's weight
    blocks: a fresh multi-megabyte allocation on every call is mapped from the system and page-faulted again each
    time, which costs more than decoding the weight (benchmarks/CPU_DECODE.md)."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf
