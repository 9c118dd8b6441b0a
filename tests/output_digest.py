"""Digests of the package's outputs on a fixed set of calls, to show that a change of structure changed no result.

    python tests/output_digest.py models                         # codec bytes, saved checkpoints, logits
    TRITON_INTERPRET=1 python tests/output_digest.py kernels     # the Triton kernels under the interpreter (CPU)

Each line is `name sha256`; run it on two trees and compare the outputs (`diff`). Not a test module: the digests
of one tree are meaningful only beside those of another, on the same machine and library versions.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import torch

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(11))


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


def model_digests():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conftest import tiny_llama_config
    from test_moe import qwen3_5_moe
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
    sources = {"llama": (llama, AutoModelForCausalLM), "qwen3_5_moe": (moe, AutoModelForCausalLM)}
    configs = {"tq3": TurboQuantConfig(bits=3, group_size=64),
               "mixed": TurboQuantConfig(bits=3, group_size=128, module_bits={"down_proj": 4}, expert_bits=1.58)}
    for source_name, (model, cls) in sources.items():
        src = os.path.join(tmp, source_name)
        model.to(torch.bfloat16).save_pretrained(src)
        for config_name, config in configs.items():
            q = cls.from_pretrained(src, quantization_config=config, dtype=torch.float32)
            with torch.no_grad():
                yield f"{source_name} {config_name} logits on the fly", digest(q(input_ids=IDS).logits)
            out = os.path.join(tmp, f"{source_name}-{config_name}")
            q.save_pretrained(out)
            yield f"{source_name} {config_name} saved tensors", digest_folder(out)
            again = cls.from_pretrained(out, dtype=torch.float32)
            with torch.no_grad():
                yield f"{source_name} {config_name} logits reloaded", digest(again(input_ids=IDS).logits)


def kernel_digests():
    import turboquant_hf.kernels as k
    from turboquant_hf import codec
    from turboquant_hf import format as fmt
    from turboquant_hf.modules import format_constants

    for bits in (2, 3, 4, fmt.TERNARY):
        n_levels = fmt.levels_for_bits(bits)
        for g in (64, 128):
            n, width = 32, 2 * g
            gen = torch.Generator().manual_seed(n_levels * g)
            packed, norms = codec.quantize_weight(torch.randn(n, width, generator=gen), bits, g)
            cb, s1, s2 = format_constants(n_levels, g, "cpu")
            for m in (1, 3, 16, 40):
                x = torch.randn(m, width, generator=gen)
                y = k._cuda_linear(x, packed, norms, cb, s1, s2, g, width)
                yield f"linear bits={bits} G={g} M={m}", digest(y)
    e, h, i, top_k, g = 4, 128, 64, 2, 64
    gen = torch.Generator().manual_seed(5)
    gu_packed, gu_norms = codec.quantize_weight(torch.randn(e, 2 * i, h, generator=gen), 3, g)
    dn_packed, dn_norms = codec.quantize_weight(torch.randn(e, h, i, generator=gen), 3, g)
    cb, s1, s2 = format_constants(8, g, "cpu")
    for t in (1, 6, 40):
        hidden = torch.randn(t, h, generator=gen)
        index = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
        weights = torch.rand(t, top_k, generator=gen)
        y = k._cuda_moe_experts(hidden, index, weights, gu_packed, gu_norms, cb, dn_packed, dn_norms, cb, s1, s2, g,
                                e, "silu")
        yield f"moe_experts 3-bit T={t}", digest(y)


def main(which: str) -> None:
    groups = {"models": [codec_digests, model_digests], "kernels": [kernel_digests]}[which]
    for group in groups:
        for name, value in group():
            print(f"{name}: {value}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "models")
