"""The `turboquant-hf` command line's arguments (the commands themselves are in `commands`)."""

from __future__ import annotations

import argparse

from ..reporting.sizing import KV_DTYPE_BYTES

_EPILOG = """\
exit codes:
  0    success
  1    unexpected failure (the message says what failed)
  2    bad input: unknown recipe, not a TurboQuant checkpoint, no safetensors, missing file, output exists
  3    the Hub failed: authentication (401/403), server error (5xx), dropped connection; safe to retry
  4    plan: the model does not fit the --gpu-gb / --ram-gb budget
  130  interrupted (no output directory is left behind)

environment: HF_TOKEN (write token for push), HF_ENDPOINT (another Hub), HF_HUB_CACHE.
"""


def _parse_bits(value: str):
    from ..format import constants as fmt

    try:
        return fmt.check_bits(float(value) if "." in value else int(value)) if value[0].isdigit() else \
            fmt.check_bits(value)
    except (ValueError, IndexError) as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _parse_size(value: str) -> int:
    """Bytes from `24GB`, `24GiB`, `500MB`, `2.5e10` or `1000000`."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "K": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    text = value.strip().upper().replace(" ", "")
    number = text.rstrip("KMGTIB")
    try:
        size = float(number) * units[text[len(number):]]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a size (examples: 24GB, 512MiB, 2e9)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a size must be positive")
    return int(size)


def _add_recipe_args(p, default_bits: bool = True) -> None:
    from ..quantization.recipes import recipe_names

    g = p.add_argument_group("recipe (pick one of --recipe, --config, or --bits/--group-size)")
    g.add_argument("--recipe", metavar="NAME", help=f"a named recipe: {', '.join(recipe_names())}")
    g.add_argument("--config", metavar="FILE", help="a quantization_config JSON file (TurboQuantConfig settings)")
    g.add_argument("--bits", type=_parse_bits, default=None,
                   help="bits per weight: 2, 3, 4 or 1.58 (ternary); default 3 (with --recipe: overrides its default)")
    g.add_argument("--group-size", type=int, choices=(64, 128, 256), default=None,
                   help="weights per group along the input dimension (default 128)")


def build_parser() -> argparse.ArgumentParser:
    fmt_cls = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="turboquant-hf", formatter_class=fmt_cls, epilog=_EPILOG,
        description="TurboQuant weight quantization for Hugging Face transformers: quantize a model, evaluate it "
                    "against its base, write its model card, push it to the Hub, and plan memory before "
                    "downloading anything.")
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"turboquant-hf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _quantize_parser(sub, fmt_cls)
    _push_parser(sub, fmt_cls)
    _card_parser(sub, fmt_cls)
    _plan_parser(sub, fmt_cls)
    _eval_parser(sub, fmt_cls)
    _convert_parser(sub, fmt_cls)
    _dequantize_parser(sub, fmt_cls)
    return parser


def _quantize_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("quantize", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="quantize a model and save it (optionally evaluate and push it)",
                       description="Load SRC (a local folder or a Hub repo) with a TurboQuant quantization_config, "
                                   "quantize it while it loads, and save the checkpoint, tokenizer and model card in "
                                   "--out. The output is written to a hidden temporary folder beside --out and renamed "
                                   "at the end: an interrupted run leaves no --out behind. Models larger than the "
                                   "memory budget (or any, with --streaming) go through the streaming converter: "
                                   "tensor by tensor into shards, with --resume after an interruption.")
    p.add_argument("src", help="base model: a local folder or a Hub repo id")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    _add_recipe_args(p)
    p.add_argument("--base-model", metavar="REPO_ID", help="Hub id of the base model for the card's base_model "
                                                          "(default: SRC when it is a Hub id)")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float16", "float32"),
                   help="dtype of the layers kept in full precision (default bfloat16)")
    p.add_argument("--device", help="cpu, cuda, or auto (device_map); default: cpu when the model is loaded whole, "
                                    "the best available (cuda if present) for the streaming converter")
    p.add_argument("--eval", metavar="TEXT", help="a text file: measure perplexity and KL against SRC, into the card")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens of --eval text to use (default 1024)")
    p.add_argument("--window", type=int, default=512, help="evaluation window in tokens (default 512)")
    p.add_argument("--push-to-hub", metavar="REPO", help="push the result to this Hub repo when done")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    p.add_argument("--force", action="store_true", help="replace --out if it exists (only once the new one is complete)")
    c = p.add_argument_group("calibrated rounding (same tq3_native bytes, indices and norms chosen on activations)")
    c.add_argument("--calibration", metavar="DATA",
                   help="a UTF-8 text file to calibrate on, or 'data-free' (the model writes its own text); use text "
                        "other than the evaluation text")
    c.add_argument("--calibration-samples", type=int, default=16, metavar="N",
                   help="calibration sequences (default 16)")
    c.add_argument("--calibration-length", type=int, default=512, metavar="T",
                   help="tokens per calibration sequence (default 512)")
    c.add_argument("--distill-steps", type=int, default=0, metavar="N",
                   help="after the rounding, N steps that tune the group norms and the vector parameters to the base "
                        "model's next-token distributions on the calibration sequences (a quarter kept out to check "
                        "it; undone unless they gain; default 0: none)")
    c.add_argument("--block-steps", type=int, default=0, metavar="N",
                   help="after each decoder block's rounding, N steps that tune its group norms and vector parameters "
                        "to the base model's block outputs on the calibration sequences (a quarter kept out to check "
                        "each block; default 0: none)")
    c.add_argument("--target-bits", type=float, metavar="BITS",
                   help="a budget in stored bits per quantized weight, group norms included (3-bit at G=128 is "
                        "3.25, 4-bit 4.25): the layers where 4 bits pay most, measured on the calibration data, "
                        "get them until the budget is met; written to module_bits in the checkpoint")
    g = p.add_argument_group("streaming conversion (a local safetensors folder, tensor by tensor, bounded memory)")
    g.add_argument("--streaming", action="store_true",
                   help="use the streaming converter whatever the model's size (default: only when the weights "
                        "exceed --max-memory, or the available memory)")
    g.add_argument("--max-memory", type=_parse_size, metavar="SIZE",
                   help="memory budget, e.g. 24GB: larger models are converted tensor by tensor, using at most this "
                        "much working memory; refused if smaller than the largest tensor")
    g.add_argument("--resume", action="store_true",
                   help="continue an interrupted streaming conversion into the same --out from its finished shards")
    g.add_argument("--max-shard-size", type=_parse_size, default=5 * 10**9, metavar="SIZE",
                   help="largest output shard (default 5GB)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _push_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("push", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="push a TurboQuant checkpoint folder to the Hub with its model card",
                       description="Upload DIR to the Hub repo REPO in one commit, with a freshly rendered model card "
                                   "as README.md (files in DIR are not modified). Needs HF_TOKEN with write access.")
    p.add_argument("dir", help="a folder written by `turboquant-hf quantize` or save_pretrained")
    p.add_argument("repo", help="Hub repo id (namespace/name, or name for your own namespace)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--message", help="commit message")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _card_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("card", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="(re)generate DIR/README.md from what is in DIR",
                       description="Render the model card of the TurboQuant checkpoint in DIR from its files (sizes "
                                   "from the safetensors headers, recipe from config.json, quality from "
                                   "turboquant_eval.json) and write it to DIR/README.md.")
    p.add_argument("dir")
    p.add_argument("--repo-id", help="the Hub repo the card's usage examples load from")
    p.add_argument("--base-model", metavar="REPO_ID", help="Hub id of the base model")
    p.add_argument("--stdout", action="store_true", help="print the card instead of writing README.md")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _plan_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("plan", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="project memory use from config.json and safetensors headers only",
                       description="Read config.json and the safetensors headers of SRC (a local folder, or a Hub "
                                   "repo: only the first bytes of each file are fetched) and project the quantized "
                                   "weights per tier (exact), the KV cache per token of the full-attention layers, "
                                   "the constant state of linear-attention layers, and whether it fits a budget. "
                                   "A checkpoint already quantized with TurboQuant is planned as it is stored: its "
                                   "bytes and its tiers as written (--recipe, --config, --bits do not apply).")
    p.add_argument("src", help="a local folder or a Hub repo id")
    _add_recipe_args(p)
    p.add_argument("--context", type=int, help="tokens of context to plan for (default: max_position_embeddings)")
    p.add_argument("--batch", type=int, default=1, help="sequences at once (default 1)")
    p.add_argument("--kv-dtype", default="bf16", choices=sorted(KV_DTYPE_BYTES), help="KV cache dtype (default bf16)")
    p.add_argument("--gpu-gb", type=float, help="GPU memory budget in GB (10^9 bytes); exit code 4 if it does not fit")
    p.add_argument("--ram-gb", type=float, help="CPU memory budget in GB; exit code 4 if it does not fit")
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="tensor parallel size (from_pretrained(..., tp_plan='auto') on N GPUs): bytes per GPU, "
                        "and --gpu-gb applies to each GPU (default 1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _eval_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("eval", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="perplexity, KL divergence and top-1 agreement of a quantized model against its base",
                       description="Run the base and the quantized model (float32) over the same token windows of "
                                   "a text file and report both perplexities, the mean KL(base || quantized) and the "
                                   "top-1 agreement (the share of positions where both models' most likely next "
                                   "tokens are the same). Use text the model was not calibrated on.")
    p.add_argument("dir", help="the quantized checkpoint folder")
    p.add_argument("--base", required=True, help="the base model it was quantized from (folder or Hub repo id)")
    p.add_argument("--text", required=True, help="a plain-text file")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens of text to use (default 1024)")
    p.add_argument("--window", type=int, default=512, help="window in tokens (default 512)")
    p.add_argument("--write-card", action="store_true",
                   help="store the result in DIR/turboquant_eval.json and rewrite DIR/README.md with it")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _convert_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("convert", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="requantize a turboquant-mlx checkpoint into the tq3_native layout (lossy)",
                       description="Load SRC, a turboquant-mlx checkpoint (or a folder saved from one), requantize "
                                   "each of its quantized layers at its own tier into tq3_native (per-group seed-42 "
                                   "rotation, as the vLLM plugin serves), save it in --out, and report the error "
                                   "this adds to the MLX weights (also in --out/turboquant_convert.json).")
    p.add_argument("src", help="a local folder")
    p.add_argument("--to", required=True, choices=("tq3_native",), help="the target layout")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--group-size", type=int, choices=(64, 128, 256), default=None,
                   help="tq3_native group size (default: each layer's own, or 64)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="dtype of the layers kept in full precision (default: the checkpoint's)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _dequantize_parser(sub, fmt_cls) -> None:
    p = sub.add_parser("dequantize", formatter_class=fmt_cls, epilog=_EPILOG,
                       help="write a TurboQuant checkpoint back as an ordinary one (no quantization_config)",
                       description="Load SRC (a TurboQuant folder or Hub repo), replace every quantized module by the "
                                   "plain module it stands for, holding the weights the quantized model computes with, "
                                   "and save that in --out with the tokenizer: a checkpoint any transformers loads.")
    p.add_argument("src", help="a TurboQuant checkpoint: a local folder or a Hub repo id")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                   help="dtype of the restored weights (default: that of the embeddings)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
