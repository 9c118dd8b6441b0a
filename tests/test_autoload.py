"""Programs that never import turboquant_hf (lm-eval, TRL scripts, front ends): the start-up hook
(`turboquant_hf.pth` -> `turboquant_hf_autoload`) lets them load TurboQuant checkpoints through transformers alone,
with the same logits, and imports turboquant_hf only when such a checkpoint is read."""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import textwrap

import torch
from conftest import make_tokenizer, spread_weights_


def _fresh(code: str, **env_overrides) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET", "TURBOQUANT_AUTOLOAD")}
    env.update(env_overrides)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.abspath(__file__)))


def test_hook_is_installed_and_costs_nothing_until_transformers():
    """The .pth is in this interpreter's site-packages; a fresh interpreter has the hook's module and no
    transformers or turboquant_hf; `TURBOQUANT_AUTOLOAD=0` leaves the registry alone."""
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    pth = [os.path.join(d, "turboquant_hf.pth") for d in dirs if os.path.isfile(os.path.join(d, "turboquant_hf.pth"))]
    assert pth, f"turboquant_hf.pth is not installed in {dirs}"
    with open(pth[0], encoding="utf-8") as f:
        assert f.read().startswith("import turboquant_hf_autoload")
    probe = """
        import sys
        print(sorted(m for m in ("turboquant_hf_autoload", "turboquant_hf", "transformers", "torch") if m in sys.modules))
        from transformers.quantizers import auto
        print(type(auto.AUTO_QUANTIZER_MAPPING.get("turboquant")).__name__, auto.AUTO_QUANTIZER_MAPPING.get("turboquant")
              and auto.AUTO_QUANTIZER_MAPPING["turboquant"].__name__, "turboquant_hf" in sys.modules)
    """
    r = _fresh(probe)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == "['turboquant_hf_autoload']"
    assert second.split()[1:] == ["TurboQuantQuantizerStandIn", "False"]
    r = _fresh(probe, TURBOQUANT_AUTOLOAD="0")
    assert r.returncode == 0 and r.stdout.splitlines()[1].split()[1:] == ["None", "False"], r.stdout + r.stderr


def test_startup_cost_is_measured():
    """The hook's share of a bare interpreter start (`python -X importtime -c pass`): its own module only, well
    under a millisecond with compiled bytecode."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)  # (writes the bytecode once)
    times = []
    for _ in range(3):
        r = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env, capture_output=True,
                           text=True, check=True)
        lines = [ln for ln in r.stderr.splitlines() if ln.rstrip().endswith("turboquant_hf_autoload")]
        assert len(lines) == 1, r.stderr[-2000:]
        times.append(int(re.search(r"import time:\s+\d+ \|\s+(\d+)", lines[0]).group(1)))
    assert min(times) < 5000, times  # microseconds, cumulative (it imports nothing else)


def _save_dense(tiny_llama_dir, path):
    from transformers import AutoModelForCausalLM

    from turboquant_hf import TurboQuantConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=3),
                                                 dtype=torch.bfloat16)
    model.save_pretrained(path)
    return model


def _save_moe(path):
    from test_moe import qwen3_moe
    from transformers import AutoModelForCausalLM

    from turboquant_hf import TurboQuantConfig

    torch.manual_seed(0)
    base = os.path.join(path, "base")
    spread_weights_(qwen3_moe()).to(torch.bfloat16).save_pretrained(base)
    make_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=TurboQuantConfig(bits=3, group_size=64),
                                                 dtype=torch.bfloat16)
    out = os.path.join(path, "tq3")
    model.save_pretrained(out)
    make_tokenizer(out)
    return model, out


def test_program_that_never_imports_us_gets_the_same_logits(tiny_llama_dir, tmp_path):
    """A dense and an MoE checkpoint, loaded in one fresh interpreter through `AutoModelForCausalLM` (both) and
    `pipeline` (dense), give the logits of the models that saved them; with the hook off, the dense one does not."""
    dense = str(tmp_path / "dense-tq3")
    model = _save_dense(tiny_llama_dir, dense)
    make_tokenizer(dense)
    moe_model, moe = _save_moe(str(tmp_path))
    ids = torch.arange(3, 23).view(1, -1)
    with torch.no_grad():
        want = {"dense": model(ids).logits.float(), "moe": moe_model(ids).logits.float()}
    torch.save(ids, tmp_path / "ids.pt")
    out = {k: str(tmp_path / f"{k}.pt") for k in ("dense", "moe", "pipe")}
    program = f"""
        import sys, torch
        from transformers import AutoModelForCausalLM, pipeline
        ids = torch.load({str(tmp_path / 'ids.pt')!r})
        for path, out in (({dense!r}, {out['dense']!r}), ({moe!r}, {out['moe']!r})):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
            assert "turboquant_hf" in sys.modules
            with torch.no_grad():
                torch.save(model(ids).logits.float(), out)
        pipe = pipeline("text-generation", model={dense!r}, dtype=torch.bfloat16)
        with torch.no_grad():
            torch.save(pipe.model(ids).logits.float(), {out['pipe']!r})
    """
    r = _fresh(program)
    assert r.returncode == 0, r.stderr[-3000:]
    assert torch.equal(torch.load(out["dense"]), want["dense"])
    assert torch.equal(torch.load(out["moe"]), want["moe"])
    assert torch.equal(torch.load(out["pipe"]), want["dense"])
    # with the hook off, transformers alone cannot read the checkpoint: the module is not ours
    os.remove(out["dense"])
    off = f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({dense!r}, dtype=torch.bfloat16)
        assert "turboquant_hf" not in sys.modules
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / 'ids.pt')!r})).logits.float(), {out['dense']!r})
    """
    r = _fresh(off, TURBOQUANT_AUTOLOAD="0")
    assert r.returncode != 0 or not torch.equal(torch.load(out["dense"]), want["dense"]), r.stderr[-2000:]
