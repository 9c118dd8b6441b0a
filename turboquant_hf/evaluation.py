"""Quality of a quantized model against its base on real text: perplexity and KL divergence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class QualityReport:
    tokens: int
    base_perplexity: float
    quantized_perplexity: float
    mean_kl: float  # mean over predicted tokens of KL(base || quantized), in nats

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


def perplexity_from(log_probs: list[torch.Tensor], ids: torch.Tensor, window: int = 512) -> float:
    nll = sum(-lp.gather(1, t[:, None]).sum().item() for lp, t in zip(log_probs, targets(ids, window)))
    return math.exp(nll / (len(ids) - 1))


def compare_log_probs(base_lp, quant_lp, ids: torch.Tensor, window: int = 512) -> QualityReport:
    kl = sum((b.exp() * (b - q)).sum().item() for b, q in zip(base_lp, quant_lp))
    n = len(ids) - 1
    return QualityReport(n, perplexity_from(base_lp, ids, window), perplexity_from(quant_lp, ids, window), kl / n)


def compare_on_text(base, quantized, ids: torch.Tensor, window: int = 512) -> QualityReport:
    """Perplexity of both models and mean KL(base || quantized) over the same token windows."""
    return compare_log_probs(window_log_probs(base, ids, window), window_log_probs(quantized, ids, window), ids, window)
