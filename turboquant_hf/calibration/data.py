"""Calibration data: the token sequences that calibrated rounding measures activations on, and the record of where
they came from (`config.calibrated_with`).

`CalibrationConfig.data` may be:
- `"data-free"`: the model writes its own text by sampling from a few neutral prompts (`generate_calibration_ids`);
- a path to a UTF-8 text file: tokenized as one text;
- a list of strings: each tokenized on its own, joined into one stream with the tokenizer's EOS token between them;
- a list of token-id tensors (1-D or 2-D): used as given, each row split into sequences of `sequence_length`
  (a remainder shorter than that is dropped);
- a `datasets.Dataset` with a `text` column (when `datasets` is installed): its rows as a list of strings, in an
  order shuffled by the seed, read until there is text enough.

Text is cut into non-overlapping sequences of `sequence_length` tokens; each starts with the tokenizer's BOS token
when it has one (followed by `sequence_length - 1` tokens of the text), as the model sees text at inference; with
an encoder's tokenizer (CLS and SEP, no BOS: BERT) each is CLS, text, SEP. When the
data holds more sequences than `samples`, a subset is drawn with a generator seeded by `seed`; when it holds fewer,
all are used (with a warning) and the record says how many.
"""

from __future__ import annotations

import hashlib
import os
import warnings

import torch

from ..quantization.config import DATA_FREE, CalibrationConfig

# Data-free generation: the prompts (each after BOS when the tokenizer has one; "" is BOS alone) and the sampling.
DATA_FREE_PROMPTS = ("", "The", "In the", "It is", "One of the", "A")
DATA_FREE_SETTINGS = {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "batch_size": 16}


def _resolve_tokenizer(cal: CalibrationConfig, model, tokenizer, required: bool):
    tok = cal.tokenizer if cal.tokenizer is not None else tokenizer
    if isinstance(tok, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.fspath(tok))
    if tok is None:
        source = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        if source:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(source)
            except (OSError, ValueError):
                tok = None
    if tok is None and required:
        raise ValueError(
            "calibration data is text, but there is no tokenizer to turn it into tokens: pass "
            "CalibrationConfig(tokenizer=<a tokenizer or its path>), or give token-id tensors as the data"
        )
    return tok


def _bos_id(tokenizer, model):
    if tokenizer is not None:
        return tokenizer.bos_token_id
    return getattr(getattr(model, "config", None), "bos_token_id", None)


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _is_dataset(data) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(data, datasets.Dataset)


def _kind(data) -> str:
    if isinstance(data, str) and data == DATA_FREE:
        return "data-free"
    if isinstance(data, (str, os.PathLike)):
        return "text-file"
    if isinstance(data, (list, tuple)):
        if not data:
            raise ValueError("CalibrationConfig.data is an empty list: give at least one string or token tensor")
        if all(isinstance(x, str) for x in data):
            return "strings"
        if all(isinstance(x, torch.Tensor) for x in data):
            return "token-ids"
        bad = next(i for i, x in enumerate(data) if not isinstance(x, type(data[0])) or
                   not isinstance(x, (str, torch.Tensor)))
        raise TypeError(
            f"CalibrationConfig.data: element {bad} is a {type(data[bad]).__name__}; a list must hold only strings or "
            "only token-id tensors"
        )
    if _is_dataset(data):
        return "dataset"
    if type(data).__module__.split(".")[0] == "datasets":
        raise TypeError(f"CalibrationConfig.data: a {type(data).__name__} from `datasets` is not supported; give a "
                        "datasets.Dataset with a `text` column (e.g. one split of a DatasetDict)")
    raise TypeError(
        f"CalibrationConfig.data: {type(data).__name__} is not calibration data; give 'data-free', a path to a UTF-8 "
        "text file, a list of strings, a list of token-id tensors, or a datasets.Dataset with a `text` column "
        "(needs the `datasets` package)"
    )


def _read_text_file(path) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        hint = "; to calibrate on a string of text, pass it in a list: data=[text]" if "\n" in path or \
            len(path) > 255 else ""
        shown = path if len(path) <= 120 else path[:117] + "..."
        raise FileNotFoundError(
            f"calibration data file not found: {shown} (CalibrationConfig.data is 'data-free', a path to a UTF-8 "
            f"text file, a list of strings, a list of token-id tensors, or a datasets.Dataset){hint}"
        )
    with open(path, encoding="utf-8") as f:
        return f.read()


def _dataset_texts(data):
    if "text" not in data.column_names:
        raise ValueError(f"calibration dataset has no `text` column (columns: {', '.join(data.column_names)})")
    return data


def _stream_from_texts(texts, tokenizer, eos, needed: int, order=None) -> list[int]:
    """One token stream of the texts (in `order` when given), EOS between them, stopping once `needed` tokens exist."""
    stream: list[int] = []
    indices = order if order is not None else range(len(texts))
    for i in indices:
        text = texts[int(i)]
        if not isinstance(text, str):
            raise TypeError(f"calibration text {int(i)} is a {type(text).__name__}, not a string")
        if not text:
            continue
        if stream and eos is not None:
            stream.append(eos)
        stream.extend(_encode(tokenizer, text))
        if len(stream) >= needed:
            break
    return stream


def _frame(tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens around each sequence: BOS first when the tokenizer has one; else, for an encoder's
    tokenizer (BERT: CLS and SEP, no BOS), CLS first and SEP last; else none."""
    if tokenizer.bos_token_id is not None:
        return [tokenizer.bos_token_id], []
    cls, sep = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
    if cls is not None and sep is not None:
        return [cls], [sep]
    return [], []


def _split_stream(stream: list[int], tokenizer, cal: CalibrationConfig, what: str) -> list[torch.Tensor]:
    prefix, suffix = _frame(tokenizer)
    body = cal.sequence_length - len(prefix) - len(suffix)
    if len(stream) < body:
        framing = f", plus {len(prefix) + len(suffix)} special token(s)" if prefix or suffix else ""
        raise ValueError(
            f"{what} gives {len(stream)} tokens; one calibration sequence needs {body} "
            f"(sequence_length {cal.sequence_length}{framing}): give more text or a smaller sequence_length"
        )
    return [torch.tensor([prefix + stream[s: s + body] + suffix], dtype=torch.long)
            for s in range(0, len(stream) - body + 1, body)]


def _split_tensors(data, cal: CalibrationConfig, vocab_size) -> list[torch.Tensor]:
    out = []
    t = cal.sequence_length
    for i, x in enumerate(data):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise TypeError(f"calibration token tensor {i} has dtype {x.dtype}; token ids are integers")
        if x.dim() == 1:
            x = x.unsqueeze(0)
        if x.dim() != 2:
            raise ValueError(f"calibration token tensor {i} has shape {tuple(x.shape)}; give 1-D or 2-D token ids")
        if x.numel() and (int(x.min()) < 0 or (vocab_size is not None and int(x.max()) >= vocab_size)):
            raise ValueError(f"calibration token tensor {i} holds ids outside [0, {vocab_size}) (the model's "
                             "vocabulary)")
        x = x.detach().to("cpu", torch.long)
        for row in x:
            out += [row[s: s + t].unsqueeze(0).clone() for s in range(0, row.numel() - t + 1, t)]
    if not out:
        longest = max(x.shape[-1] if x.dim() else 1 for x in data)
        raise ValueError(f"calibration token tensors are too short: the longest row has {longest} tokens; one "
                         f"sequence needs {t} (sequence_length)")
    return out


def _choose(pool: list[torch.Tensor], cal: CalibrationConfig, what: str) -> list[torch.Tensor]:
    if len(pool) < cal.samples:
        warnings.warn(f"{what} holds {len(pool)} sequences of {cal.sequence_length} tokens; {cal.samples} were asked "
                      "for: calibrating on all of them", stacklevel=3)
        return pool
    g = torch.Generator().manual_seed(cal.seed)
    return [pool[i] for i in torch.randperm(len(pool), generator=g)[: cal.samples].tolist()]


def data_free_settings(cal: CalibrationConfig) -> dict:
    """Prompts and sampling settings of the data-free mode: the defaults, updated by `cal.options["data_free"]`."""
    given = dict(cal.options.get("data_free", {}) or {})
    unknown = sorted(set(given) - set(DATA_FREE_SETTINGS) - {"prompts"})
    if unknown:
        raise ValueError(f"CalibrationConfig.options['data_free']: unknown setting(s) {', '.join(unknown)} (known: "
                         f"prompts, {', '.join(DATA_FREE_SETTINGS)})")
    out = dict(DATA_FREE_SETTINGS, prompts=list(DATA_FREE_PROMPTS))
    out.update(given)
    if not out["prompts"] or not all(isinstance(p, str) for p in out["prompts"]):
        raise ValueError("CalibrationConfig.options['data_free']['prompts'] must be a non-empty list of strings")
    return out


@torch.no_grad()
def generate_calibration_ids(model, tokenizer, samples: int, sequence_length: int, seed: int = 0,
                             prompts=DATA_FREE_PROMPTS, temperature: float = 1.0, top_p: float = 0.95,
                             top_k: int = 0, batch_size: int = 16) -> list[torch.Tensor]:
    """`samples` sequences of exactly `sequence_length` tokens written by `model` itself: sample i continues
    prompt `i % len(prompts)` (after BOS), sampled at `temperature` with nucleus `top_p` (and `top_k` when > 0),
    EOS suppressed, `batch_size` sequences at a time (left-padded prompts). Seeded: the same arguments on the same
    device give the same ids; the global random state is left as it was."""
    can_generate = getattr(model, "can_generate", lambda: False)()
    if not can_generate:
        raise ValueError(
            f"data-free calibration needs a model that generates text, and {type(model).__name__} does not "
            "(an encoder such as BERT has no next-token head): give real text instead, e.g. "
            "CalibrationConfig(data='sentences.txt') or a list of strings, or quantize without calibration"
        )
    bos = _bos_id(tokenizer, model)
    if tokenizer is None:
        prompts = [""]  # without a tokenizer, BOS alone is the one prompt there is
    prompt_ids = []
    for p in prompts:
        ids = ([bos] if bos is not None else []) + (_encode(tokenizer, p) if p else [])
        if ids:
            prompt_ids.append(ids[: sequence_length - 1])
    if not prompt_ids:
        raise ValueError("data-free calibration: the model has no BOS token and no tokenizer was given, so there is "
                         "no prompt to start from; pass CalibrationConfig(tokenizer=...)")
    device = next(model.parameters()).device
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    eos = eos if eos is not None else getattr(model.generation_config, "eos_token_id", None)
    pad = eos if isinstance(eos, int) else (eos[0] if eos else 0)
    kwargs = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": int(top_k), "num_beams": 1,
              "pad_token_id": pad, "eos_token_id": eos}
    out_rows: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, samples, batch_size):
            rows = [prompt_ids[i % len(prompt_ids)] for i in range(start, min(samples, start + batch_size))]
            width = max(map(len, rows))
            # left-padded to one width; each row keeps its prompt plus the first tokens it generated
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long, device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long,
                                device=device)
            new = sequence_length - min(map(len, rows))
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kwargs).cpu()
            for r, row in zip(rows, out):
                out_rows.append(row[width - len(r): width - len(r) + sequence_length].unsqueeze(0).clone())
    model.train(was_training)
    return out_rows


def calibration_batches(cal: CalibrationConfig, model, tokenizer=None) -> list[torch.Tensor]:
    """The calibration sequences of `cal` for `model`: a list of (1, sequence_length) LongTensors on the CPU, at
    most `cal.samples` of them, chosen reproducibly from `cal.seed` (see the module docstring for each kind of
    data). `tokenizer` is used for text when `cal.tokenizer` is not set."""
    if not isinstance(cal, CalibrationConfig):
        raise TypeError(f"calibration_batches takes a CalibrationConfig, got {type(cal).__name__}")
    kind = _kind(cal.data)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if kind == "token-ids":
        return _choose(_split_tensors(cal.data, cal, vocab), cal, "the calibration token tensors")
    if kind == "data-free":
        tok = _resolve_tokenizer(cal, model, tokenizer, required=False)
        s = data_free_settings(cal)
        return generate_calibration_ids(model, tok, cal.samples, cal.sequence_length, cal.seed, s["prompts"],
                                        s["temperature"], s["top_p"], s["top_k"], s["batch_size"])
    if kind == "text-file":
        text = _read_text_file(cal.data)  # before the tokenizer: a missing file is the first thing to report
        tok = _resolve_tokenizer(cal, model, tokenizer, required=True)
        what = f"the calibration file {os.path.basename(os.fspath(cal.data))}"
        return _choose(_split_stream(_encode(tok, text), tok, cal, what), cal, what)
    tok = _resolve_tokenizer(cal, model, tokenizer, required=True)
    needed = cal.samples * cal.sequence_length
    if kind == "strings":
        what = f"the {len(cal.data)} calibration strings"
        stream = _stream_from_texts(list(cal.data), tok, tok.eos_token_id, needed=float("inf"))
        return _choose(_split_stream(stream, tok, cal, what), cal, what)
    texts = _dataset_texts(cal.data)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(cal.seed)).tolist()
    what = f"the calibration dataset ({len(texts)} rows)"
    stream = _stream_from_texts(texts["text"], tok, tok.eos_token_id, needed, order)
    return _choose(_split_stream(stream, tok, cal, what), cal, what)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _dataset_name(data) -> str:
    info = getattr(data, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None) or "dataset"
    split = getattr(data, "split", None)
    return f"{name}" + (f" ({split})" if split else "")


def describe(cal: CalibrationConfig, batches: list[torch.Tensor]) -> dict:
    """The `calibrated_with` record of calibrating on `batches` (as `calibration_batches(cal, ...)` returned them):
    kind, source (a file's base name and the sha256 of its text; never a local path), samples, sequence_length,
    tokens, seed and the sha256 of the token ids; for the data-free mode, the prompts and sampling settings."""
    kind = _kind(cal.data)
    digest = hashlib.sha256()
    for b in batches:
        digest.update(b.to(torch.int64).contiguous().numpy().tobytes())
    record = {"kind": kind}
    if kind == "text-file":
        text = _read_text_file(cal.data)
        record["source"] = os.path.basename(os.fspath(cal.data))
        record["source_sha256"] = _sha256_text(text)
    elif kind == "strings":
        record["source"] = f"list of {len(cal.data)} strings"
        record["source_sha256"] = _sha256_text("\n".join(cal.data))
    elif kind == "token-ids":
        record["source"] = f"list of {len(cal.data)} token-id tensors"
    elif kind == "dataset":
        record["source"] = _dataset_name(cal.data)
        fingerprint = getattr(cal.data, "_fingerprint", None)
        if fingerprint:
            record["source_fingerprint"] = fingerprint
    else:
        s = data_free_settings(cal)
        record["source"] = "self-generated by the model being quantized (sampled from neutral prompts)"
        record["prompts"] = list(s["prompts"])  # each after BOS; "" is BOS alone
        record["sampling"] = {k: s[k] for k in ("temperature", "top_p", "top_k")}
    record.update(samples=len(batches), sequence_length=cal.sequence_length,
                  tokens=int(sum(b.numel() for b in batches)), seed=cal.seed, tokens_sha256=digest.hexdigest())
    return record
