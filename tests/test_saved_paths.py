"""Nothing this package writes records a path of the machine that wrote it: save_pretrained, the CLI (both
quantize paths, eval), and push_to_hub name their source by Hub id or folder base name only."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from hub_fixtures import *  # noqa: F401,F403  (local_hub, hub_env, hub_in_process)
from transformers import AutoModelForCausalLM

from turboquant_hf import TurboQuantConfig
from turboquant_hf.cli import commands as cli
from turboquant_hf.format.checkpoint import public_command, public_source

TEXT_SUFFIXES = (".json", ".md", ".txt", ".jinja", ".yaml")


def _machine_paths(*extra) -> list[str]:
    paths = {os.path.realpath(tempfile.gettempdir()), tempfile.gettempdir(), os.path.expanduser("~")}
    paths.update(os.fspath(p) for p in extra)
    return sorted(p.rstrip("/") + "/" for p in paths if p not in ("", "/"))


def _assert_no_machine_path(files: dict[str, bytes], *extra) -> None:
    assert files
    for name, data in files.items():
        if name.endswith(TEXT_SUFFIXES):
            text = data.decode("utf-8")
            for path in _machine_paths(*extra):
                assert path not in text and path.rstrip("/") + '"' not in text, (name, path)


def _read(directory) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(directory):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), directory)] = f.read()
    return out


def test_public_names():
    assert public_source("org/model") == "org/model"
    assert public_source("/data/hub/models--org--model/snapshots/abc123") == "org/model"
    assert public_source("/home/someone/models/SmolLM2-135M/") == "SmolLM2-135M"
    assert public_source(None) is None
    assert public_command("turboquant-hf quantize /srv/x/base --out=/srv/y/out --bits 3") == \
        "turboquant-hf quantize base --out=out --bits 3"


def test_save_pretrained_records_no_path(tiny_llama_dir, tmp_path):
    src = tmp_path / "my-base"
    shutil.copytree(tiny_llama_dir, src)
    (src / "README.md").write_text("---\nlicense: mit\n---\n# base\n")
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=TurboQuantConfig(bits=3))
    model.save_pretrained(tmp_path / "q")
    files = _read(tmp_path / "q")
    assert {"tq_config.json", "turboquant_build.json", "README.md"} <= set(files)
    _assert_no_machine_path(files, src, tmp_path)
    assert b'"original_model": "my-base"' in files["tq_config.json"]
    assert b"license: mit" in files["README.md"]  # the base card was still read from the local folder


@pytest.mark.parametrize("streaming", [False, True], ids=["from_pretrained", "streaming"])
def test_cli_quantize_and_eval_record_no_path(streaming, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    text = tmp_path / "words.txt"
    text.write_text(" ".join(["the a of to and in is it you that he was for on are with as his they be"] * 20))
    args = ["quantize", tiny_llama_dir, "--out", str(out), "--bits", "3", "--eval", str(text), "--max-tokens", "200"]
    assert cli.main(args + (["--streaming"] if streaming else [])) == 0
    assert cli.main(["eval", str(out), "--base", tiny_llama_dir, "--text", str(text), "--max-tokens", "200",
                     "--write-card"]) == 0
    files = _read(out)
    assert {"tq_config.json", "turboquant_build.json", "turboquant_eval.json", "README.md"} <= set(files)
    _assert_no_machine_path(files, tiny_llama_dir, tmp_path)


def test_push_to_hub_uploads_no_path(hub_in_process, tiny_llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4))
    with torch.no_grad():
        model.push_to_hub("tester/no-paths")
    files = hub_in_process.files("tester/no-paths")
    assert {"tq_config.json", "README.md", "config.json"} <= set(files)
    _assert_no_machine_path(files, tiny_llama_dir, tmp_path)
