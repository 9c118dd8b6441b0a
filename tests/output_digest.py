"""Digests of the package's outputs on a fixed set of calls, to show that a change of structure changed no result.

    python tests/output_digest.py models                         # codec bytes, saved checkpoints, logits
    TRITON_INTERPRET=1 python tests/output_digest.py kernels     # every kernel family under the interpreter (CPU)
    python tests/output_digest.py compare REV [models|kernels]   # both groups on REV and on this tree, then a diff

Each line is `name: sha256 prefix`. `compare` checks REV out into a temporary git worktree, runs this file against
that tree's package and against this tree's (each imported through a folder of links on PYTHONPATH, one torch
and BLAS thread), prints the lines that differ and exits 1 if any do. Not a test module: the digests of one tree
are meaningful only beside those of another, on the same machine and library versions.

The kernel group calls the public launchers of `turboquant_hf.kernels` (`linear`, `rotate`, `gemv_*`,
`dequantize_*`, `moe_experts`, `hadamard_moe_experts`) on every bit width, the published and the runtime layout,
float32, bfloat16 and float16 activations and an M on each side of every dispatch threshold, and again with each
tuning switch moved so that every variant of a kernel family runs (`tuned`).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import os
import subprocess
import sys
import tempfile

import torch

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(11))
HERE = os.path.dirname(os.path.abspath(__file__))


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def digest_folder(path: str) -> str:
    from safetensors.torch import load_file

    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return digest(*[tensors[k] for k in sorted(tensors)]) + f" ({len(tensors)} tensors)"


# ---------------------------------------------------------------------------------------------------------------
# models: codec bytes, on-the-fly and streaming quantization, saved tensors, logits
# ---------------------------------------------------------------------------------------------------------------

def codec_digests():
    from turboquant_hf import codec
    from turboquant_hf import format as fmt

    for bits in (2, 3, 4, fmt.TERNARY):
        for g in (64, 128, 256):
            for dtype in (torch.bfloat16, torch.float32):
                w = torch.randn(48, 3 * g - 40, generator=torch.Generator().manual_seed(g), dtype=torch.float32)
                packed, norms = codec.quantize_weight(w.to(dtype), bits, g)
                back = codec.dequantize_weight(packed, norms, w.shape[1], g, dtype=torch.float32)
                yield f"codec bits={bits} G={g} {dtype}", digest(packed, norms, back)


def _runtime_layout():
    try:
        from turboquant_hf.format import runtime_layout
    except ImportError:  # a tree from before the package had subfolders
        from turboquant_hf import layout as runtime_layout
    return runtime_layout


def _streaming_quantizer(source: str):
    try:
        from turboquant_hf.streaming import StreamingQuantizer
    except ImportError:  # a tree from before the streaming quantizer had its name
        from turboquant_hf.converter import TurboQuantizer as StreamingQuantizer
    return StreamingQuantizer(source)


def model_digests():
    sys.path.insert(0, HERE)
    from conftest import qwen3_5_moe, tiny_llama_config
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from turboquant_hf import TurboQuantConfig

    tmp = tempfile.mkdtemp()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(tiny_llama_config())
    torch.manual_seed(0)
    moe = qwen3_5_moe()
    for model in (llama, moe):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 and "conv1d" not in name:
                    p.normal_(0, 0.05)
    configs = {"tq3": {"bits": 3, "group_size": 64},
               "mixed": {"bits": 3, "group_size": 128, "module_bits": {"down_proj": 4}, "expert_bits": 1.58}}
    for source_name, model in {"llama": llama, "qwen3_5_moe": moe}.items():
        src = os.path.join(tmp, source_name)
        model.to(torch.bfloat16).save_pretrained(src)
        for config_name, config in configs.items():
            q = AutoModelForCausalLM.from_pretrained(src, quantization_config=TurboQuantConfig(**config),
                                                     dtype=torch.float32)
            with torch.no_grad():
                yield f"{source_name} {config_name} logits on the fly", digest(q(input_ids=IDS).logits)
            out = os.path.join(tmp, f"{source_name}-{config_name}")
            q.save_pretrained(out)
            yield f"{source_name} {config_name} saved tensors", digest_folder(out)
            again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            with torch.no_grad():
                yield f"{source_name} {config_name} logits reloaded", digest(again(input_ids=IDS).logits)
            streamed = os.path.join(tmp, f"{source_name}-{config_name}-streamed")
            _streaming_quantizer(src).quantize(streamed, quantization_config=TurboQuantConfig(**config),
                                               device="cpu", progress=False, model_card=False)
            yield f"{source_name} {config_name} streaming quantizer tensors", digest_folder(streamed)


# ---------------------------------------------------------------------------------------------------------------
# kernels (TRITON_INTERPRET=1): every family through its public launcher
# ---------------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tuned(**values):
    """Set tuning constants for the block: in `kernels.tuning`, or in the module that holds them in an older tree
    (`kernels.linear` for the linear kernels), always `kernels.moe` for the MoE ones."""
    from turboquant_hf.kernels import linear, moe

    try:
        from turboquant_hf.kernels import tuning
    except ImportError:
        tuning = linear
    homes = {name: next(m for m in (tuning, linear, moe) if hasattr(m, name)) for name in values}
    old = {name: getattr(home, name) for name, home in homes.items()}
    for name, value in values.items():
        setattr(homes[name], name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(homes[name], name, value)


def _weight(shape, bits, g: int, seed: int, runtime: bool = False):
    """(packed, norms, codebook the kernels read it with, signs1, signs2) of a random weight, in the runtime
    layout when `runtime`."""
    from turboquant_hf import codec
    from turboquant_hf import format as fmt

    layout = _runtime_layout()

    packed, norms = codec.quantize_weight(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), bits, g)
    nl = fmt.levels_for_bits(bits)
    cb = fmt.codebook(nl, g)
    s1, s2 = fmt.signs(g)
    if runtime:
        packed = layout.to_runtime(packed, nl, g, norms.shape[-1])
        cb = layout.runtime_codebook(cb)
    return packed, norms, cb, s1, s2


def _layouts(bits, g: int):
    from turboquant_hf import format as fmt

    layout = _runtime_layout()

    return (False, True) if layout.supports(fmt.levels_for_bits(bits), g) else (False,)


def linear_digests():
    from turboquant_hf.kernels import linear as L

    from turboquant_hf import format as fmt

    gen = torch.Generator().manual_seed(7)
    dtypes = {torch.float32: (1, 3, 17, 40), torch.bfloat16: (1, 2, 3, 16, 17, 40, 65), torch.float16: (1, 2, 5, 33)}
    for bits in (2, 3, 4, fmt.TERNARY):
        for g in (64, 128):
            for runtime in _layouts(bits, g):
                k = 2 * g + 40  # three groups, the last one padded
                w = _weight((24, k), bits, g, seed=int(bits * 10) + g, runtime=runtime)
                for dtype, ms in dtypes.items():
                    for m in ms:
                        x = torch.randn(m, k, generator=gen).to(dtype)
                        yield f"linear bits={bits} G={g} runtime={runtime} {dtype} M={m}", digest(
                            L.linear(x, w[0], w[1], w[2], w[3], w[4], g, k))
    # each tuning switch moved: activation order, wide blocks, no mid-M GEMV, the tensor-core rotation at small M,
    # the pair GEMV at four rows, the FMA GEMV for 16-bit rows
    cases = [("x_order", {"X_ORDER_MIN": 0}, (3, 16)), ("no x_order", {"X_ORDER": False, "X_ORDER_MIN": 0}, (3,)),
             ("wide", {"WIDE_MIN": 0}, (5, 16, 24)), ("no mid", {"MID_MAX_M": 0}, (17, 40)),
             ("tensor-core rotation", {"ROWS_MAX_M": 0}, (1, 3)), ("pairs at 4 rows", {"PAIR_MAX_M": 4}, (3, 4)),
             ("fma for 16-bit", {"FMA_MAX_M": 16}, (2, 7))]
    for name, values, ms in cases:
        for bits, g in ((3, 128), (4, 64), (2, 128)):
            k = 4 * g
            w = _weight((40, k), bits, g, seed=bits + g, runtime=True)
            with tuned(**values):
                for m in ms:
                    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
                    yield f"linear {name} bits={bits} G={g} M={m}", digest(L.linear(x, *w, g, k))


def launcher_digests():
    """The launchers the op's dispatch does not reach under the interpreter, or reaches with one argument only."""
    from turboquant_hf.kernels import linear as L

    from turboquant_hf import format as fmt

    gen = torch.Generator().manual_seed(9)
    for bits in (2, 3, 4, fmt.TERNARY):
        nl = fmt.levels_for_bits(bits)
        for g in (64, 128):
            for runtime in _layouts(bits, g):
                k = 2 * g
                seed = int(bits * 10) + g + 1
                packed, norms, cb, s1, s2 = _weight((3 * 16, k), bits, g, seed=seed, runtime=runtime)
                tag = f"bits={bits} G={g} runtime={runtime}"
                for dt in (torch.bfloat16, torch.float32) if cb.numel() != 3 else ():  # (no lookup for base-3 bytes)
                    yield f"dequantize_lut {tag} {dt}", digest(L.dequantize_lut(packed, norms, cb, g, dt))
                    yield f"dequantize_lut unrotated {tag} {dt}", digest(
                        L.dequantize_lut(packed, norms, cb, g, dt, s1, s2, k - 24))
                if cb.numel() != 3:
                    yield f"dequantize_lut select {tag}", digest(L.dequantize_lut(
                        packed, norms, cb, g, torch.bfloat16, select=torch.tensor([2, 0]), select_rows=16))
                yield f"dequantize_rotated {tag}", digest(L.dequantize_rotated(packed, norms, cb, g, torch.float32))
                idx = torch.tensor([[2, 0], [1, 3]])  # routed pairs over three stacked matrices; 3: no expert
                x = L.rotate(torch.randn(2, k, generator=gen), s1, s2, g, torch.float32)
                yield f"gemv_fma experts {tag}", digest(
                    L.gemv_fma(x, packed, norms, cb, g, torch.float32, experts=3, expert_index=idx, x_div=2))
                unit = L.lut_unit(nl, g)
                if unit:
                    for m in (1, 2, 20):
                        xp, xs = L.rotate(torch.randn(m, k, generator=gen).bfloat16(), s1, s2, g, torch.bfloat16,
                                          unit=unit)
                        yield f"rotate pairs {tag} M={m}", digest(xp, xs)
                    xp, xs = L.pack_pairs(x, unit, g)
                    yield f"pack_pairs {tag}", digest(xp, xs)
                    yield f"gemv_pairs experts {tag}", digest(
                        L.gemv_pairs(xp, xs, packed, norms, cb, g, torch.bfloat16, experts=3, expert_index=idx,
                                     x_div=2))


def moe_digests():
    from turboquant_hf.kernels import moe

    from turboquant_hf import codec
    from turboquant_hf import format as fmt

    layout = _runtime_layout()

    e, h, inter, g = 6, 128, 64, 64
    for bits, runtime in ((3, True), (4, False), (4, True), (fmt.TERNARY, False), (fmt.TERNARY, True)):
        gen = torch.Generator().manual_seed(int(bits * 100))
        gu_p, gu_n = codec.quantize_weight(torch.randn(e, 2 * inter, h, generator=gen), bits, g)
        d_p, d_n = codec.quantize_weight(torch.randn(e, h, inter, generator=gen), bits, g)
        if bits == fmt.TERNARY:
            gu_n, d_n = gu_n.half(), d_n.half()
        nl = fmt.levels_for_bits(bits)
        cb = fmt.codebook(nl, g)
        s1, s2 = fmt.signs(g)
        if runtime:
            gu_p, d_p = layout.to_runtime(gu_p, nl, g, h // g), layout.to_runtime(d_p, nl, g, inter // g)
            cb = layout.runtime_codebook(cb)
        chunked = 2 * (3 * inter * h) * 4
        plans = {"decode": (2, {}), "fused": (4, {}),
                 "decoded in chunks": (4, {"PREFILL_SCRATCH_BYTES": chunked, "FUSED_MAX_PAIRS": 0}),
                 "decoded at once": (4, {"PREFILL_SCRATCH_BYTES": 1 << 30, "FUSED_MAX_PAIRS": 0}),
                 "decoded unrotated": (4, {"PREFILL_SCRATCH_BYTES": 1 << 30, "FUSED_MAX_PAIRS": 0,
                                               "PREFILL_ROTATED_BASIS": False})}
        for plan, (t, values) in plans.items():
            if plan == "decoded unrotated" and bits != 3:
                continue
            hidden = torch.randn(t, h, generator=gen).to(torch.bfloat16)
            index = torch.randint(0, e, (t, 3), generator=gen)
            index[0, 1] = e
            index[t - 1, 0] = -1
            weights = torch.rand(t, 3, generator=gen)
            with tuned(PAIR_MAX_ROWS=8, **values):
                y = moe.moe_experts(hidden, index, weights, gu_p, gu_n, cb, d_p, d_n, cb, s1, s2, g, e, "silu")
            yield f"moe_experts bits={bits} runtime={runtime} {plan}", digest(y)
    yield from _hadamard_moe_digests()


def _hadamard_moe_digests():
    from turboquant_hf.kernels import moe

    try:
        from turboquant_hf.kernels.registry import _cuda_hadamard_linear
    except ImportError:  # (trees from before the registration moved into kernels/registry.py)
        from turboquant_hf.kernels import _cuda_hadamard_linear

    from turboquant_hf import codec
    from turboquant_hf import format as fmt

    layout = _runtime_layout()

    e, h, inter, g = 5, 192, 128, 64
    for tiers in ((3, 3, 3), (fmt.TERNARY, fmt.TERNARY, 4)):
        gen = torch.Generator().manual_seed(len(str(tiers)))
        parts = []
        for bits, shape in zip(tiers, ((e, inter, h), (e, inter, h), (e, h, inter))):
            packed, norms = codec.quantize_weight(torch.randn(*shape, generator=gen), bits, g)
            cb = fmt.codebook(fmt.levels_for_bits(bits), g) * 1.5
            signs = torch.randint(0, 2, (shape[-1],), generator=gen).float() * 2 - 1
            parts += [packed, norms.half(), cb.half(), signs.half()]
        idx = torch.tensor([[1, 4, 0], [3, 5, 2], [2, 2, 1], [0, 3, 4]])
        wts = torch.rand(4, 3, generator=gen)
        hidden = torch.randn(4, h, generator=gen).to(torch.bfloat16)
        with tuned(PAIR_MAX_ROWS=8):
            y = moe.hadamard_moe_experts(hidden[:2], idx[:2], wts[:2], *parts, e, "silu")
        yield f"hadamard_moe_experts {tiers} decode", digest(y)
        for i in range(3):
            if parts[4 * i + 2].numel() == 3:
                parts[4 * i] = layout.to_runtime(parts[4 * i], 3, g, parts[4 * i + 1].shape[1])
                parts[4 * i + 2] = layout.pairs_codebook(parts[4 * i + 2])
        for plan, values in (("fused", {}), ("decoded", {"FUSED_MAX_PAIRS": 0, "PREFILL_SCRATCH_BYTES": 1 << 30})):
            with tuned(PAIR_MAX_ROWS=8, **values):
                y = moe.hadamard_moe_experts(hidden, idx, wts, *parts, e, "silu")
            yield f"hadamard_moe_experts {tiers} {plan}", digest(y)
    gen = torch.Generator().manual_seed(13)
    signs = torch.randint(0, 2, (h,), generator=gen).half() * 2 - 1
    for bits in (3, 4):
        packed, norms = codec.quantize_weight(torch.randn(inter, h, generator=gen), bits, g)
        cb = (fmt.codebook(fmt.levels_for_bits(bits), g) * 1.5).half()
        for m in (1, 3, 40):
            x = torch.randn(m, h, generator=gen).to(torch.bfloat16)
            yield f"hadamard linear bits={bits} M={m}", digest(
                _cuda_hadamard_linear(x, packed, norms.half(), cb, signs, g, h))


# ---------------------------------------------------------------------------------------------------------------
# compare: two trees, one machine
# ---------------------------------------------------------------------------------------------------------------

def _links(tree: str, where: str) -> str:
    """A folder whose `turboquant_hf` package is `tree`'s (its kernels/ and model_cards/ as subpackages)."""
    pkg = os.path.join(where, "turboquant_hf")
    os.makedirs(pkg)
    for name in os.listdir(os.path.join(tree, "turboquant_hf")):
        if name != "__pycache__":
            os.symlink(os.path.join(tree, "turboquant_hf", name), os.path.join(pkg, name))
    for name in ("kernels", "model_cards"):
        os.symlink(os.path.join(tree, name), os.path.join(pkg, name))
    return where


def _start(tree: str, group: str, where: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=_links(tree, where), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TRITON_INTERPRET="1" if group == "kernels" else "0", OUTPUT_DIGEST_ISOLATED="1")
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), group], env=env, cwd=where,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lines(run: subprocess.Popen, tree: str, group: str, where: str) -> list[str]:
    out, err = run.communicate()
    lines = out.splitlines()
    if run.returncode or not lines or not lines[0].startswith(f"package: {where}"):
        raise SystemExit(f"the {group} digests of {tree} failed:\n{out[-2000:]}\n{err[-4000:]}")
    return lines[1:]


def compare(rev: str, groups: list[str]) -> int:
    """Each group on REV and on this tree, the two runs side by side; the differing lines, exit status 1 if any."""
    root = os.path.dirname(HERE)
    tmp = tempfile.mkdtemp(prefix="output_digest_")
    old = os.path.join(tmp, "tree")
    subprocess.run(["git", "-C", root, "worktree", "add", "--detach", old, rev], check=True, capture_output=True)
    differ = 0
    try:
        for group in groups:
            where = {name: os.path.join(tmp, f"{name}-{group}") for name in ("old", "new")}
            runs = {"old": _start(old, group, where["old"]), "new": _start(root, group, where["new"])}
            a = _lines(runs["old"], old, group, where["old"])
            b = _lines(runs["new"], root, group, where["new"])
            diff = list(difflib.unified_diff(a, b, f"{rev} {group}", f"this tree {group}", lineterm="", n=0))
            differ += bool(diff)
            print(f"{group}: {len(b)} digests, {'identical' if not diff else 'DIFFERENT'} against {rev}")
            print("\n".join(diff), flush=True)
    finally:
        subprocess.run(["git", "-C", root, "worktree", "remove", "--force", old], check=False,
                       capture_output=True)
    return 1 if differ else 0


def _isolate() -> None:
    """Leave the package to PYTHONPATH alone: an editable install's finder would answer for a module the tree under
    test lacks with the installed tree's file."""
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")
                        and not getattr(f, "__module__", "").startswith("__editable__")]


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        if len(argv) < 2:
            raise SystemExit("usage: output_digest.py compare REV [models|kernels]")
        return compare(argv[1], argv[2:] or ["models", "kernels"])
    groups = {"models": [codec_digests, model_digests],
              "kernels": [linear_digests, launcher_digests, moe_digests]}
    which = argv[0] if argv else "models"
    if which not in groups:
        raise SystemExit(f"unknown group {which!r}: models, kernels or compare REV")
    if which == "kernels" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the kernel digests run under the Triton interpreter: set TRITON_INTERPRET=1")
    if os.environ.get("OUTPUT_DIGEST_ISOLATED"):
        _isolate()
    import turboquant_hf

    torch.set_num_threads(1)
    print(f"package: {os.path.dirname(os.path.dirname(turboquant_hf.__file__))}", flush=True)
    for group in groups[which]:
        for name, value in group():
            print(f"{name}: {value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
