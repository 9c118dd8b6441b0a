"""Tuning a quantized model's continuous parameters to its float model, indices fixed: block by block to the float
blocks' outputs, and end to end to the float model's next-token distributions.

A tq3_native checkpoint stays valid whatever its norms are, so after the rounding the group norms of every
per-group `TurboQuantLinear` (and the parameters kept in full precision that are vectors: norm-layer weights,
biases) can be tuned. `tune_block` does it for one decoder block as soon as it is rounded (the calibration pass
calls it): Adam steps lower the relative squared error between the block's output and the float block's output
on the float model's own hidden states. The end-to-end pass tunes the whole model after the rounding: the float
model's distributions on the calibration sequences are recorded before its weights are quantized
(`teacher_targets`: each position's `TOP_K` most likely tokens and their log-probabilities, the rest of the
vocabulary as one outcome), and `distill` lowers the mean KL divergence of the quantized model's distributions to
them by Adam steps on `log norm` (each norm `n0 * exp(theta)`) and on the vector parameters, on three quarters of
the sequences; the last quarter checks it, and the tuning is undone unless their KL fell. The packed indices, the codebook and every matrix kept in full precision stay as they are.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from ..format import codec
from ..modeling.modules import TurboQuantLinear

# Most likely tokens of each teacher distribution kept as outcomes of their own (the rest of the vocabulary is one).
TOP_K = 64
# Learning rate of the vector parameters relative to that of the log-norms.
VECTOR_LR_SCALE = 0.1


def teacher_targets(model: nn.Module, batches: list[torch.Tensor], top_k: int = TOP_K) -> list[tuple]:
    """For each calibration batch `(1, L)`, the float model's `(token ids, log-probabilities)` of its `top_k` most
    likely next tokens at every position (`(L, top_k)` each, on the CPU). Call before the weights are quantized."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in batches:
            logits = getattr(model(input_ids=ids.to(device)), "logits", None)
            if logits is None:
                raise ValueError(f"CalibrationConfig(distill_steps=...) tunes to next-token distributions; "
                                 f"{type(model).__name__} returns no logits")
            logp = F.log_softmax(logits[0].float(), -1)
            values, index = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
            out.append((index.cpu(), values.cpu()))
    return out


def coarse_kl(logits: torch.Tensor, index: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || model) between the distributions coarsened to the teacher's top tokens
    and one outcome for the rest of the vocabulary (a lower bound of the full KL divergence)."""
    logp = F.log_softmax(logits.float(), -1).gather(-1, index)
    p = teacher_logp.exp()
    p_rest = (1 - p.sum(-1)).clamp_min(1e-12)
    q_rest = (1 - logp.exp().sum(-1)).clamp_min(1e-12)
    kl = (p * (teacher_logp - logp)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    return kl.mean()


class _TunedNorms:
    """A per-group `TurboQuantLinear` computing with `unit * n0 * exp(theta)` (unit: its weight dequantized with
    unit norms) while it is tuned; `finish` writes the tuned norms back and restores its forward."""

    def __init__(self, module: TurboQuantLinear, dtype: torch.dtype):
        w = module.weight
        self.module = module
        self.n0 = w.tq_norms.float().clone()
        g, ng = w.group_size, w.n_groups
        unit = codec.dequantize_weight(w.published_packed(), torch.ones_like(self.n0), ng * g, g)
        self.unit = unit.view(-1, ng, g).to(dtype)
        self.theta = nn.Parameter(torch.zeros_like(self.n0))
        in_features, unit_, n0, theta = module.in_features, self.unit, self.n0, self.theta

        def forward(x):
            weight = (unit_ * (n0 * theta.exp()).unsqueeze(-1).to(unit_.dtype)).view(unit_.shape[0], -1)
            return F.linear(x, weight[:, :in_features].to(x.dtype), module.bias)

        module.forward = forward

    def finish(self) -> None:
        with torch.no_grad():
            norms = self.module.weight.tq_norms
            norms.copy_((self.n0 * self.theta.exp()).to(norms.dtype))
        del self.module.forward


def _adam_tune(module: nn.Module, dtype: torch.dtype, lr: float, steps: int, loss_at, check) -> tuple:
    """The tuning both passes share: `steps` Adam steps on the log-norms of the per-group `TurboQuantLinear`s in
    `module` (learning rate `lr`, their weights unpacked in `dtype` meanwhile) and on its vector parameters (norm
    weights, biases; `lr * VECTOR_LR_SCALE`), step i lowering `loss_at(i)`. `check()` (a float, gradients off) is
    measured before and after; when it did not fall, every parameter goes back to its value before. The tuned norms
    are written back in their own dtype and the parameters' `requires_grad` restored. Returns (check before, check
    after, whether the tuning was kept)."""
    tuned = [_TunedNorms(m, dtype) for m in module.modules()
             if isinstance(m, TurboQuantLinear) and m.weight.rotation == "groups" and m.weight.tp_shard is None]
    vectors = [p for p in module.parameters() if p.dim() == 1 and p.is_floating_point()]
    initial = [p.detach().clone() for p in vectors]
    grad_before = {id(p): p.requires_grad for p in module.parameters()}
    for p in module.parameters():
        p.requires_grad_(False)
    for p in vectors:
        p.requires_grad_(True)
    groups = [{"params": [t.theta for t in tuned], "lr": lr}]
    if vectors:
        groups.append({"params": vectors, "lr": lr * VECTOR_LR_SCALE})
    opt = torch.optim.Adam(groups)
    try:
        with torch.enable_grad():
            with torch.no_grad():
                before = check()
            for step in range(steps):
                loss = loss_at(step)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            with torch.no_grad():
                after = check()
        kept = after < before
        if not kept:
            with torch.no_grad():
                for t in tuned:
                    t.theta.zero_()
                for p, p0 in zip(vectors, initial):
                    p.copy_(p0)
    finally:
        for t in tuned:
            t.finish()
        for p in module.parameters():
            p.requires_grad_(grad_before[id(p)])
    return before, after, kept


def distill(model: nn.Module, batches: list[torch.Tensor], targets: list[tuple], steps: int, lr: float,
            batch_size: int = 2) -> dict:
    """`steps` Adam steps on the log-norms of every per-group `TurboQuantLinear` (learning rate `lr`) and on every
    vector parameter (norm weights, biases; `lr * VECTOR_LR_SCALE`), `batch_size` sequences a step, cycling through
    the calibration sequences but the last `held_out(len(batches))`. Those are kept out to check the result: when
    their mean coarse KL did not fall, every parameter goes back to its value before tuning (`_adam_tune`).
    Returns what was tuned, the coarse KL of the held-out sequences before and after, and whether the tuning was
    kept. Memory: each tuned layer's weight is held unpacked while this runs (float32 on a CPU, the model's dtype on
    an accelerator), besides the activations of `batch_size` sequences."""
    device = next(model.parameters()).device
    dtype = torch.float32 if device.type == "cpu" else next(model.parameters()).dtype
    n_check = held_out(len(batches))
    train = list(range(len(batches) - n_check))
    check = list(range(len(batches) - n_check, len(batches)))

    def loss_of(chosen):
        ids = torch.cat([batches[i] for i in chosen]).to(device)
        index = torch.stack([targets[i][0] for i in chosen]).to(device)
        teacher = torch.stack([targets[i][1] for i in chosen]).to(device)
        return coarse_kl(model(input_ids=ids).logits, index, teacher)

    def loss_at(step):
        first = step * batch_size
        return loss_of([train[(first + i) % len(train)] for i in range(min(batch_size, len(train)))])

    was_training = model.training
    model.eval()  # (no dropout: the teacher's distributions were recorded without it)
    start = time.perf_counter()
    try:
        before, after, kept = _adam_tune(model, dtype, lr, steps, loss_at,
                                         lambda: sum(float(loss_of([i])) for i in check) / len(check))
    finally:
        model.train(was_training)
    return {"parameters": "group norms and vector parameters", "steps": steps, "lr": lr,
            "train_sequences": len(train), "held_out_sequences": len(check),
            "top_tokens": int(targets[0][0].shape[-1]),
            "held_out_kl_before": round(before, 6), "held_out_kl_after": round(after, 6), "kept": kept,
            "seconds": round(time.perf_counter() - start, 1)}


def tune_block(block: nn.Module, hidden: list, calls: list, targets: list, run, steps: int, lr: float) -> dict:
    """`steps` Adam steps on the log-norms of the per-group `TurboQuantLinear`s of `block` (learning rate `lr`) and on
    its vector parameters (`lr * VECTOR_LR_SCALE`), one batch a step, lowering the relative squared error
    `|block(hidden) - target|^2 / |target|^2` (`run(block, hidden[i], calls[i])` runs the block). The last
    `held_out(len(hidden))` batches check it (all of them when there is one); when their error did not fall, every
    parameter goes back to its value before (`_adam_tune`). Returns the mean relative error of the checking batches
    before and after, and whether the tuning was kept."""
    n_check = held_out(len(hidden)) if len(hidden) > 1 else 0
    train = list(range(len(hidden) - n_check))
    check = list(range(len(hidden) - n_check, len(hidden))) if n_check else train
    scale = [float(t.float().pow(2).mean().clamp_min(1e-30)) for t in targets]

    def error(i):
        out = run(block, hidden[i], calls[i])
        return (out.float() - targets[i].float()).pow(2).mean() / scale[i]

    dtype = torch.float32 if hidden[0].device.type == "cpu" else hidden[0].dtype
    before, after, kept = _adam_tune(block, dtype, lr, steps, lambda step: error(train[step % len(train)]),
                                     lambda: sum(float(error(i)) for i in check) / len(check))
    return {"error_before": before, "error_after": after, "kept": kept}


def held_out(n: int) -> int:
    """How many of `n` calibration sequences `distill` keeps out of the tuning to check it: a quarter, at least
    one."""
    if n < 2:
        raise ValueError(f"CalibrationConfig(distill_steps=...) needs at least 2 calibration sequences (one is kept "
                         f"out to check the tuning), got {n}")
    return max(1, n // 4)
