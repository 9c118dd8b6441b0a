"""Quality of a quantized model against its base on real text: perplexity, KL divergence and top-1 agreement."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass

import torch


@dataclass
class QualityReport:
    tokens: int
    base_perplexity: float
    quantized_perplexity: float
    mean_kl: float  # mean over predicted tokens of KL(base || quantized), in nats
    top1_agreement: float  # share of predicted positions where both models' most likely next tokens are the same

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def tokenize_text(tokenizer, text: str, max_tokens: int) -> torch.Tensor:
    """Token ids of `text`, starting with BOS when the tokenizer has one, cut to `max_tokens`."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    if tokenizer.bos_token_id is not None and (len(ids) == 0 or ids[0] != tokenizer.bos_token_id):
        ids = torch.cat([torch.tensor([tokenizer.bos_token_id]), ids])
    return ids[:max_tokens]


@torch.no_grad()
def window_log_probs(model, ids: torch.Tensor, window: int = 512) -> list[torch.Tensor]:
    """Float32 log-probabilities of `model` over consecutive windows of `ids` (each predicting its next tokens)."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        logits = model(chunk[:-1].unsqueeze(0).to(device)).logits[0].float().cpu()
        out.append(torch.log_softmax(logits, -1))
    return out


def targets(ids: torch.Tensor, window: int = 512) -> list[torch.Tensor]:
    return [ids[start + 1 : start + window + 1] for start in range(0, len(ids) - 1, window)]


def _window_sums(base_lp: torch.Tensor, quant_lp: torch.Tensor, target: torch.Tensor) -> tuple[float, ...]:
    """Summed negative log-likelihoods (base, quantized), KL(base || quantized) and top-1 agreements of one window."""
    nll_b = -base_lp.gather(1, target[:, None]).sum().item()
    nll_q = -quant_lp.gather(1, target[:, None]).sum().item()
    kl = (base_lp.exp() * (base_lp - quant_lp)).sum().item()
    agree = (base_lp.argmax(-1) == quant_lp.argmax(-1)).sum().item()
    return nll_b, nll_q, kl, agree


def _report(sums, n: int) -> QualityReport:
    nll_b, nll_q, kl, agree = (sum(x) for x in zip(*sums))
    return QualityReport(n, math.exp(nll_b / n), math.exp(nll_q / n), kl / n, agree / n)


def compare_log_probs(base_lp, quant_lp, ids: torch.Tensor, window: int = 512) -> QualityReport:
    sums = [_window_sums(b, q, t) for b, q, t in zip(base_lp, quant_lp, targets(ids, window))]
    return _report(sums, len(ids) - 1)


def compare_on_text(base, quantized, ids: torch.Tensor, window: int = 512) -> QualityReport:
    """Perplexity of both models, mean KL(base || quantized) and top-1 agreement over the same token windows,
    one window at a time (memory: two windows of log-probabilities, whatever the length of `ids`)."""
    sums = []
    for start, t in zip(range(0, len(ids) - 1, window), targets(ids, window)):
        chunk = ids[start: start + window + 1]
        (b,), (q,) = window_log_probs(base, chunk, window), window_log_probs(quantized, chunk, window)
        sums.append(_window_sums(b, q, t))
    return _report(sums, len(ids) - 1)


def evaluate_folder(directory: str, base: str, text_path: str, max_tokens: int, window: int, write: bool,
                    progress=None) -> dict:
    """Perplexity, mean KL and top-1 agreement of the quantized model in `directory` against `base` on the text
    file `text_path` (float32, windows of `window` tokens, at most `max_tokens`); with `write`, stored as the folder's
    evaluation record for its model card. `progress(total)`: a progress bar to update once per window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..format.checkpoint import public_source
    from . import card as tq_card

    with open(text_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError):
        tokenizer = AutoTokenizer.from_pretrained(base)
    ids = tokenize_text(tokenizer, text, max_tokens)
    if len(ids) < 2:
        raise ValueError(f"{text_path} gives fewer than 2 tokens")
    starts = list(range(0, len(ids) - 1, window))
    logprobs = {}
    bar = progress(2 * len(starts)) if progress else None
    try:
        for which, path in (("base", base), ("quantized", directory)):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            model.eval()
            out = []
            for s in starts:
                out += window_log_probs(model, ids[s: s + window + 1], window)
                if bar is not None:
                    bar.update()
            logprobs[which] = out
            del model
    finally:
        if bar is not None:
            bar.close()
    report = compare_log_probs(logprobs["base"], logprobs["quantized"], ids, window)
    result = dict(report.as_dict(), text=os.path.basename(text_path),
                  text_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(), max_tokens=max_tokens,
                  window=window, dtype="float32", base=public_source(base),
                  created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    calibrated = tq_card.read_quantization_config(directory).get("calibrated_with") or {}
    if calibrated.get("source_sha256") == result["text_sha256"]:
        result["warning"] = (f"the evaluation text is the text the model was calibrated on ({calibrated.get('source')}):"
                             " these numbers flatter it; evaluate on held-out text")
    if write:
        path = os.path.join(directory, tq_card.EVAL_NAME)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=2)
        os.replace(path + ".tmp", path)
    return result
