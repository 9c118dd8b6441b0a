"""The MoE layer and end-to-end decode on one CUDA GPU: bf16 against TurboQuant, same run.

    python benchmarks/bench_e2e.py --md E2E.md --json e2e.json [--models llama8b qwen36] [--skip-moe]
                                   [--moe-tokens 1 2048] [--compile llama8b] [--batch 1 8 32]
    python benchmarks/bench_e2e.py --profile-moe     # where the MoE layer's time goes at 2048 tokens
    python benchmarks/bench_e2e.py --skip-moe --models llama8b qwen36 --prefill 512 2048   # also prompt processing

MoE layer (E = 256, top-8, H = 2048, I = 512, the Qwen3.6-35B-A3B experts): transformers' own fused
bf16 experts module, with its "eager" implementation (a loop over the routed experts) and its "grouped_mm"
one (`torch._grouped_mm`, the default of models from `from_pretrained` where the GPU supports it), against
`TurboQuantExperts` holding the same weights quantized to 3 bits (and to ternary, in its runtime layout), at
M = 1 and M = 2048 tokens (`--moe-tokens`), the same random routing for all; eager calls timed with CUDA events,
and CUDA-graph replays where a path never waits for the host (bf16 grouped_mm; ours wherever
`kernels.moe.host_waits` says so: at decode and in the fused routed products, every M here; the bf16 loop
synchronises with the host, so it cannot be captured).

End to end: models built from their configs with random weights (std 0.02) on the GPU, bf16 and
quantized (the recipe's modules replaced exactly as `from_pretrained(..., quantization_config=...)`
does). A 16-token prompt is prefilled into a `StaticCache`, then one decode step is captured in a CUDA
graph and replayed; tokens/s over 64 steps (the argmax of each step fed back). A second row per model
times plain eager decoding (a DynamicCache, one forward per token, as `generate` runs without graphs or
compilation), where host overhead per kernel launch counts. Models named in `--compile` get a third row: the
forward compiled with `torch.compile(fullgraph=True)` (our ops are opaque custom ops there; inductor fuses what
lies between them), then captured and replayed the same way. Where capture fails, the row says why.

Prefill (`--prefill N ...`): one forward over an N-token prompt at batch 1 into a fresh cache, the logits of
its last position only (as `generate` computes them), timed as a CUDA-graph replay of the whole forward (the
device's time: the quantized layers never wait for the host at any length) and eagerly; prompt tokens/s.
"""

from __future__ import annotations

import os

os.environ.setdefault("USE_HUB_KERNELS", "0")  # (transformers 5.25 fetches Hub kernels on CUDA: none offline)

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time

import torch
import transformers
import triton
from turboquant_hf.kernels import moe as KM

import turboquant_hf  # noqa: F401
from turboquant_hf.format import codec
from turboquant_hf.integration.fusion import fuse_projections
from turboquant_hf.modeling.modules import TurboQuantExperts, TurboQuantWeight
from turboquant_hf.quantization.recipes import get_recipe
from turboquant_hf.reporting.sizing import apply_plan

DEV = "cuda"


def _events_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def _graph_us(fn, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _events_us(g.replay, reps)


# ---------------------------------------------------------------------------
# MoE layer
# ---------------------------------------------------------------------------

MOE_FAMILIES = {  # family -> (E, top-k, H, I): Qwen3.6-35B-A3B's, gpt-oss-20b's and Llama 4 Scout's expert layers
    "qwen3_5": (256, 8, 2048, 512),
    "gpt_oss": (32, 4, 2880, 2880),
    "llama4": (16, 1, 5120, 8192),
}


def _moe_modules(family: str, e: int, h: int, inter: int, g: int):
    """(transformers' bf16 experts module with random weights, its config, {tier: TurboQuantExperts of the same
    weights}) for `family`: Qwen3.5-MoE's `[E, 2I, H]` experts, or gpt-oss's transposed, interleaved, biased experts
    with the clamped SwiGLU."""
    from turboquant_hf.modeling.experts_layout import ExpertsLayout

    torch.manual_seed(0)
    if family == "gpt_oss":
        from transformers.models.gpt_oss import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        cfg = GptOssConfig(hidden_size=h, intermediate_size=inter, num_local_experts=e)
        base = GptOssExperts(cfg).to(DEV, torch.bfloat16)
        layout = ExpertsLayout(transposed=True, interleaved=True, bias=True, alpha=cfg.swiglu_alpha,
                               limit=cfg.swiglu_limit)
        activation = "clamped_swiglu"
    elif family == "llama4":
        from transformers.models.llama4 import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

        cfg = Llama4TextConfig(hidden_size=h, intermediate_size=inter, num_local_experts=e, num_experts_per_tok=1)
        base = Llama4TextExperts(cfg).to(DEV, torch.bfloat16)
        layout = ExpertsLayout(transposed=True, inputs="expert_blocks", top_k=1)
        activation = "silu"
    else:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeExperts,
        )

        cfg = Qwen3_5MoeTextConfig(hidden_size=h, moe_intermediate_size=inter, num_experts=e)
        base = Qwen3_5MoeExperts(cfg).to(DEV, torch.bfloat16)
        layout, activation = None, "silu"
    with torch.no_grad():
        base.gate_up_proj.normal_(0, 0.02)
        base.down_proj.normal_(0, 0.02)
        if layout is not None and layout.bias:
            base.gate_up_proj_bias.normal_(0, 0.1)
            base.down_proj_bias.normal_(0, 0.1)
    # the published orientation: rows are outputs, groups along the inputs
    gu = base.gate_up_proj.data.transpose(1, 2) if layout is not None else base.gate_up_proj.data
    dn = base.down_proj.data.transpose(1, 2) if layout is not None else base.down_proj.data
    tiers = {}
    for bits in (3, 1.58):
        kw = {"layout": layout} if layout is not None else {}
        ours = TurboQuantExperts(e, h, inter, bits, bits, g, activation, device=DEV, **kw)
        ours.gate_up_proj.load_packed_(*codec.quantize_weight(gu.contiguous(), bits, g))
        ours.down_proj.load_packed_(*codec.quantize_weight(dn.contiguous(), bits, g))
        if layout is not None and layout.bias:
            with torch.no_grad():
                ours.gate_up_proj_bias.copy_(base.gate_up_proj_bias)
                ours.down_proj_bias.copy_(base.down_proj_bias)
        tiers["ternary" if bits == 1.58 else "3"] = ours
    return base, cfg, tiers


def _moe_inputs(family: str, m: int, e: int, k: int, h: int):
    """The experts' arguments for `m` tokens with random top-k routing: (hidden, top_k_index, top_k_weights), or for
    Llama 4 the `(E*m, H)` expert blocks its MoE block hands its experts (each token in its expert's block, scaled
    by the sigmoid of its score; zero rows elsewhere)."""
    x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    logits = torch.randn(m, e, device=DEV)
    if family == "llama4":
        score, idx = torch.topk(logits, k, dim=-1)
        blocks = torch.zeros(e, m, h, device=DEV, dtype=torch.bfloat16)
        for j in range(k):
            blocks[idx[:, j], torch.arange(m, device=DEV)] = x * torch.sigmoid(score[:, j:j + 1]).to(x.dtype)
        return (blocks.view(e * m, h),)
    w, idx = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return x, idx, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def bench_moe(family: str = "qwen3_5", g=128, tokens=(1, 2048)) -> list[dict]:
    e, k, h, inter = MOE_FAMILIES[family]
    base, cfg, tiers = _moe_modules(family, e, h, inter, g)
    impls = ("eager",) if family == "llama4" else ("eager", "grouped_mm")  # (Llama 4's experts: one bmm path)
    rows = []
    for m in tokens:
        args = _moe_inputs(family, m, e, k, h)
        base_t = {"grouped_mm": (float("nan"), None)}
        with torch.no_grad():
            for impl in impls:
                cfg._experts_implementation = impl
                try:
                    yb = base(*args)
                    base_t[impl] = (_events_us(lambda: base(*args)), yb)
                except Exception as exc:  # (an implementation this transformers or GPU lacks)
                    print(f"bf16 experts {impl}: {exc!r}"[:300], flush=True)
                    base_t[impl] = (float("nan"), None)
            # transformers' grouped_mm path keeps its routing on the device, so it can be captured too (Llama 4's
            # bmm as well)
            t_bgg = float("nan")
            if base_t["grouped_mm"][1] is not None or family == "llama4":
                cfg._experts_implementation = impls[-1]
                try:
                    t_bgg = _graph_us(lambda: base(*args))
                except Exception as exc:
                    print(f"bf16 {impls[-1]} capture: {exc!r}"[:300], flush=True)
            yb = base_t["eager"][1]
            for bits, ours in tiers.items():
                yo = ours(*args)
                t_o = _events_us(lambda: ours(*args))
                # ours is captured wherever it does not wait for the host
                waits = KM.host_waits(m * k, e, 2 * inter * h * 2)
                t_og = float("nan") if waits else _graph_us(lambda: ours(*args))
                rel_vs_bf16 = ((yo.float() - yb.float()).norm() / yb.float().norm()).item()
                t_b, t_bg = base_t["eager"][0], base_t["grouped_mm"][0]
                row = dict(part="moe", family=family, bits=bits, M=m, us_bf16=t_b, us_bf16_grouped=t_bg,
                           us_bf16_grouped_graph=t_bgg, us_ours=t_o, us_ours_graph=t_og, ratio=t_b / t_o,
                           ratio_grouped=t_bg / t_o, ratio_graph=t_b / t_og, ratio_graph_grouped=t_bg / t_og,
                           ratio_graphs=t_bgg / t_og, rel_vs_bf16=rel_vs_bf16)
                print(json.dumps(row), flush=True)
                rows.append(row)
    del base, tiers
    torch.cuda.empty_cache()
    return rows


def profile_moe(m: int = 2048, bits=3, e=256, k=8, h=2048, inter=512, g=128, reps: int = 5) -> str:
    """Where the quantized MoE layer's time goes at `m` tokens: torch.profiler over `reps` eager calls (random
    routing, as `bench_moe`), the ops and kernels sorted by device time, then by host time."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    ours = TurboQuantExperts(e, h, inter, bits, bits, g, device=DEV)
    ours.gate_up_proj.load_packed_(*codec.quantize_weight(torch.randn(e, 2 * inter, h, device=DEV) * 0.02, bits, g))
    ours.down_proj.load_packed_(*codec.quantize_weight(torch.randn(e, h, inter, device=DEV) * 0.02, bits, g))
    x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    w, idx = torch.topk(torch.softmax(torch.randn(m, e, device=DEV), -1), k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    with torch.no_grad():
        t = _events_us(lambda: ours(x, idx, w))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                ours(x, idx, w)
            torch.cuda.synchronize()
    table = prof.key_averages()
    head = f"MoE layer, {bits}-bit, M = {m}, E = {e}, top-{k}, H = {h}, I = {inter}: {t:.0f} us a call (events, median)"
    return "\n\n".join([head, table.table(sort_by="cuda_time_total", row_limit=25),
                        table.table(sort_by="self_cpu_time_total", row_limit=25)])


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------

def llama8b_config():
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False)


def qwen36_config():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig()


MODELS = {
    "llama8b": ("Llama-3.1-8B shape", llama8b_config, "LlamaForCausalLM"),
    "qwen36": ("Qwen3.6-35B-A3B text model", qwen36_config, "Qwen3_5MoeForCausalLM"),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(config, cls_name: str, recipe: str | None, device: str = DEV):
    """The model of `config` in bf16 on `device`, random weights (normal, std 0.02; norms and the gated-delta-net
    decay parameters set as trained models have them), with the TurboQuant layers of `recipe` quantized from
    random weights of the same law (`None`: bf16 throughout)."""
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as cls  # noqa: N813
    with torch.device("meta"):
        model = cls._from_config(config, dtype=torch.bfloat16)
    if recipe:
        apply_plan(model, get_recipe(recipe))
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16, generator=gen)))
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0, 0.02, generator=gen)
            elif "norm" in name and getattr(config, "model_type", "") == "llama":
                p.fill_(1.0)
            else:
                p.zero_()
        for name, m in list(model.named_modules()):
            if isinstance(getattr(m, "inv_freq", None), torch.Tensor) and hasattr(m, "config"):
                with torch.device("cpu"):
                    fresh = type(m)(m.config)
                model.set_submodule(name, fresh.to(device))
        for name, m in model.named_modules():
            if isinstance(m, TurboQuantWeight):
                src = torch.empty(m.source_shape, dtype=torch.bfloat16, device=device)
                src.normal_(0, 0.02, generator=gen)
                m.load_packed_(*codec.quantize_weight(src, m.bits, m.group_size, name=name))
                del src
    _sync()
    return model.eval()


def _eager_tps(model, ids, steps: int) -> float:
    """Tokens/s (over the whole batch) of plain eager decoding (a DynamicCache, one forward per token): what `generate` does without
    graphs or compilation, host overhead included."""
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    tok = out.logits[:, -1:].argmax(-1)
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, past_key_values=past, use_cache=True)
        past = out.past_key_values
        tok = out.logits[:, -1:].argmax(-1)
    _sync()
    return ids.shape[0] * steps / (time.perf_counter() - t)


def _graph_tps(model, forward, ids, steps: int, prompt: int) -> float:
    """Tokens/s (over the whole batch) of decode steps `forward(...)` (the model's own forward, or a compiled
    one) captured once in a CUDA graph over a StaticCache and replayed, the argmax fed back."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt + steps + 8)
    out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device=DEV),
                use_cache=True)
    static_ids = out.logits[:, -1:].argmax(-1)
    static_pos = torch.tensor([prompt], device=DEV)

    def step():
        return forward(input_ids=static_ids, past_key_values=cache, cache_position=static_pos,
                       use_cache=True).logits

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # a compiled forward compiles on the first call
            step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        static_pos.fill_(prompt + i)
        graph.replay()
        static_ids.copy_(logits[:, -1:].argmax(-1))
    torch.cuda.synchronize()
    tps = ids.shape[0] * steps / (time.perf_counter() - t)
    del graph, cache
    return tps


def decode_tps(model, steps: int = 64, prompt: int = 16, compile: bool = False, batch: int = 1) -> list[dict]:
    """Decode tokens/s over `batch` sequences decoded together, one row per mode: a captured CUDA-graph step
    replayed; with `compile`, the same with the forward compiled by `torch.compile(fullgraph=True)` first
    (inductor fuses the norms, rotary embedding and residual adds around the linears); then plain eager
    decoding."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, prompt), device=DEV,
                        generator=torch.Generator(device=DEV).manual_seed(1))
    rows = []
    modes = [("CUDA graph", lambda: model.forward)]
    if compile:
        def compiled():
            torch._dynamo.reset()  # each batch size and recipe compiles afresh: no recompile limit across rows
            return torch.compile(model.forward, fullgraph=True, dynamic=False)

        modes.append(("torch.compile + CUDA graph", compiled))
    with torch.no_grad():
        for mode, make in modes:
            try:
                t0 = time.perf_counter()
                tps = _graph_tps(model, make(), ids, steps, prompt)
                rows.append(dict(mode=mode, tokens_per_s=tps, setup_s=time.perf_counter() - t0))
            except Exception as exc:  # noqa: BLE001 - record why; the other rows still run
                rows.append(dict(mode=mode, tokens_per_s=float("nan"), graph_error=repr(exc)[:300]))
            torch.cuda.synchronize()
        rows.append(dict(mode="eager", tokens_per_s=_eager_tps(model, ids, steps)))
    for r in rows:
        r["batch"] = batch
    return rows


def prefill_tps(model, tokens: int, reps: int = 10) -> list[dict]:
    """Prompt tokens/s of one forward over `tokens` prompt tokens (batch 1, a fresh DynamicCache, the last
    position's logits only): captured in a CUDA graph and replayed (median of `reps`), then eagerly (median of
    `reps`, host work included)."""
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, tokens), device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))

    def fwd():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

    rows = []
    with torch.no_grad():
        try:
            t_g = _graph_us(fwd, reps)
            rows.append(dict(mode=f"prefill {tokens} (CUDA graph)", tokens_per_s=tokens / t_g * 1e6))
        except Exception as exc:  # noqa: BLE001 - record why; the eager row still runs
            rows.append(dict(mode=f"prefill {tokens} (CUDA graph)", tokens_per_s=float("nan"),
                             graph_error=repr(exc)[:300]))
        torch.cuda.synchronize()
        rows.append(dict(mode=f"prefill {tokens} (eager)", tokens_per_s=tokens / _events_us(fwd, reps) * 1e6))
    for r in rows:
        r["phase"] = "prefill"
    return rows


def bench_model(key: str, recipes: list[str], compile: bool = False, fuse: bool = False,
                prefill=(), decode: bool = True, batches=(1,)) -> list[dict]:
    label, make_config, cls_name = MODELS[key]
    rows = []
    results = {}
    runs = [(None, False)] + [(r, False) for r in recipes] + ([(r, True) for r in recipes] if fuse else [])
    for recipe, fuse_it in runs:
        gc.collect()
        torch.cuda.empty_cache()
        model = build(make_config(), cls_name, recipe)
        fused = fuse_projections(model) if fuse_it else 0
        nbytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
        timed = []
        for b in batches if decode else ():
            timed += decode_tps(model, compile=compile, batch=b)
        for n in prefill:
            timed += prefill_tps(model, n)
        for r in timed:
            r.update(model=label, recipe=(recipe or "bf16") + (" (fused q/k/v, gate/up)" if fused else ""),
                     GB=nbytes / 1e9, fused_groups=fused)
            results[recipe, r["mode"], r.get("batch", 1)] = r
            if recipe:
                r["ratio"] = r["tokens_per_s"] / results[None, r["mode"], r.get("batch", 1)]["tokens_per_s"]
            print(json.dumps(r), flush=True)
            rows.append(r)
        del model
    return rows


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict:
    # the gated-delta-net layers of Qwen3.5/3.6 run transformers' PyTorch fallbacks unless these are installed:
    # both sides of the comparison share that part of the token, so it sets how far apart they can be
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, cuda=torch.version.cuda, python=platform.python_version(),
                fla=_version("flash-linear-attention"), causal_conv1d=_version("causal-conv1d"),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def markdown(env: dict, moe: list[dict], e2e: list[dict], command: str) -> str:
    out = ["# MoE layer and end-to-end decode: bf16 vs TurboQuant", "",
           f"- device: {env['device']}; torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, "
           f"transformers {env['transformers']}, Python {env['python']}",
           f"- gated-delta-net kernels (Qwen3.6 layers): flash-linear-attention {env.get('fla', 'n/a')}, "
           f"causal-conv1d {env.get('causal_conv1d', 'n/a')}",
           f"- date: {env['date']}", f"- command: `{command}`", ""]
    for family in dict.fromkeys(r.get("family", "qwen3_5") for r in moe):
        e, k, h, inter = MOE_FAMILIES[family]
        name = {"qwen3_5": "Qwen3.5/3.6-MoE", "gpt_oss": "gpt-oss-20b (transposed, interleaved, biased experts, "
                "clamped SwiGLU)", "llama4": "Llama 4 Scout (transposed experts on expert blocks; bf16: its bmm over "
                "every block)"}[family]
        out += [f"## MoE layer, {name} (E = {e}, top-{k}, H = {h}, I = {inter}; G = 128)", "",
                "bf16: transformers' experts module, \"eager\" (its loop over routed experts) and \"grouped_mm\" "
                "(its default for `from_pretrained` models); ratios are bf16 time / ours (> 1: ours faster). Eager "
                "calls, and CUDA-graph replays where the path never waits for the host (bf16 grouped_mm; ours at "
                "decode and in the fused routed products); the graph columns are the device's time.", "",
                "| M | bits | bf16 eager us | bf16 grouped_mm us | bf16 grouped_mm us (CUDA graph) | ours us (eager) | "
                "ours us (CUDA graph) | vs eager: ours eager | vs grouped_mm: ours eager | vs grouped_mm eager: ours "
                "graph | graph vs graph | rel. diff vs bf16 |",
                "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in moe if r.get("family", "qwen3_5") == family):
            nan = float("nan")
            out.append(f"| {r['M']} | {r.get('bits', '3')} | {r['us_bf16']:.0f} | {r.get('us_bf16_grouped', nan):.0f} | "
                       f"{r.get('us_bf16_grouped_graph', nan):.0f} | {r['us_ours']:.0f} | {r['us_ours_graph']:.1f} | "
                       f"{r['ratio']:.2f} | {r.get('ratio_grouped', nan):.2f} | {r.get('ratio_graph_grouped', nan):.2f} | "
                       f"{r.get('ratio_graphs', nan):.2f} | {r['rel_vs_bf16']:.3f} |")
        out.append("")
    for phase, title, unit in (("decode", "## Decode (16-token prompt, 64 new tokens; tokens/s over the batch)",
                                "tokens/s"),
                               ("prefill", "## Prefill, batch 1 (one forward over the prompt, last logits only)",
                                "prompt tokens/s")):
        rows = [r for r in e2e if r.get("phase", "decode") == phase]
        if not rows:
            continue
        out += [title, "", f"| model | weights | GB | batch | mode | {unit} | ratio vs bf16 |",
                "|---|---|---:|---:|---|---:|---:|"]
        for r in rows:
            out.append(f"| {r['model']} | {r['recipe']} | {r['GB']:.2f} | {r.get('batch', 1)} | {r['mode']} | "
                       f"{r['tokens_per_s']:.1f} | {r.get('ratio', 1.0):.2f} |")
        for r in rows:
            if "graph_error" in r:
                out.append(f"\n- {r['model']} {r['recipe']} ({r['mode']}): failed ({r['graph_error']})")
        out.append("")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=["llama8b"])
    ap.add_argument("--recipes", nargs="*", default=["tq3"])
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--moe-tokens", nargs="+", type=int, default=[1, 2048], metavar="M",
                    help="token counts the MoE layer is timed at (default: 1 2048)")
    ap.add_argument("--moe-families", nargs="+", default=["qwen3_5"], choices=sorted(MOE_FAMILIES),
                    help="the expert layers timed (default: qwen3_5; gpt_oss: gpt-oss-20b's layout)")
    ap.add_argument("--compile", nargs="*", default=[], metavar="MODEL",
                    help="also time these models with the forward compiled (torch.compile) before capture")
    ap.add_argument("--fuse", action="store_true",
                    help="also time each recipe with q/k/v and gate/up fused "
                         "(turboquant_hf.integration.fusion.fuse_projections)")
    ap.add_argument("--profile-moe", action="store_true",
                    help="only profile the quantized MoE layer at 2048 tokens (torch.profiler tables) and exit")
    ap.add_argument("--prefill", nargs="*", type=int, default=[], metavar="N",
                    help="also time prompt processing of N tokens per model and recipe (batch 1)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode rows (with --prefill: prefill only)")
    ap.add_argument("--batch", nargs="+", type=int, default=[1], metavar="B",
                    help="decode these numbers of sequences together (default: 1)")
    ap.add_argument("--md")
    ap.add_argument("--json")
    args = ap.parse_args()
    env = environment()
    print(json.dumps(env), flush=True)
    if args.profile_moe:
        print(profile_moe(), flush=True)
        return 0
    moe = [] if args.skip_moe else [r for f in args.moe_families for r in bench_moe(f, tokens=args.moe_tokens)]
    e2e = []
    for key in args.models:
        recipes = args.recipes if key != "qwen36" else sorted(set(args.recipes) | {"tq3", "tq3a-tqTe"})
        e2e += bench_model(key, recipes, compile=key in args.compile, fuse=args.fuse, prefill=args.prefill,
                           decode=not args.no_decode, batches=args.batch)
    md = markdown(env, moe, e2e, "python " + " ".join(sys.argv))
    print(md)
    if args.md:
        open(args.md, "w").write(md)
    if args.json:
        json.dump(dict(env=env, moe=moe, e2e=e2e), open(args.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
