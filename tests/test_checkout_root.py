"""From where a contributor stands: a `python` started in the checkout's root, whose folder comes first on
`sys.path` (the other tests run with it removed, see conftest). The top-level `kernels/` folder holds the kernels'
source and must never stand in for the `kernels` distribution that transformers imports; the command line, the
imports and a load of a saved checkpoint work from there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(*args: str, isolated: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    cmd = [sys.executable, *(("-I",) if isolated else ()), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_root_folder_does_not_shadow_the_kernels_distribution():
    """`import kernels` from the root gives the installed distribution (its own file); where none is installed,
    what a folder without `__init__.py` gives (an empty namespace package), which transformers' availability
    check reads as "not installed" -- never the checkout's folder with its contents."""
    spec = importlib.util.find_spec("kernels")
    installed = spec is not None and not os.path.realpath(spec.origin).startswith(os.path.join(ROOT, ""))
    r = _python("-c", "import kernels, os; print(kernels.__file__ and os.path.realpath(kernels.__file__)); "
                      "print(hasattr(kernels, 'register'))")
    assert r.returncode == 0, r.stderr
    path, ours = r.stdout.split()
    assert path == (os.path.realpath(spec.origin) if installed else "None") and ours == "False"
    # the distribution hidden from the shim's own lookup and from the metadata (as on a machine without it, which
    # transformers 5.17 allows): transformers and the
    # package import, and `kernels` reads as not installed
    code = ("import importlib.machinery as m\n"
            "find = m.PathFinder.find_spec.__func__\n"
            "def hide(cls, name, path=None, target=None):\n"
            "    return None if name == 'kernels' and path is not None else find(cls, name, path, target)\n"
            "m.PathFinder.find_spec = classmethod(hide)\n"
            "import importlib.metadata as md\n"
            "version = md.version\n"
            "def no_kernels(name):\n"
            "    if name == 'kernels':\n"
            "        raise md.PackageNotFoundError(name)\n"
            "    return version(name)\n"
            "md.version = no_kernels\n"
            "import kernels\n"
            "from transformers.utils.import_utils import _is_package_available\n"
            "import turboquant_hf\n"
            "from transformers import AutoModelForCausalLM\n"
            "print(kernels.__file__, hasattr(kernels, 'register'), _is_package_available('kernels', return_version=True))\n")
    r = _python("-c", code)
    assert r.returncode == 0 and r.stdout.split() == ["None", "False", "(False,", "'N/A')"], (r.stdout, r.stderr)


def test_command_line_and_imports_from_root():
    r = _python("-m", "turboquant_hf", "--help")
    assert r.returncode == 0 and "usage: turboquant-hf" in r.stdout, r.stderr
    r = _python("-c", "import turboquant_hf, transformers; from transformers import AutoModelForCausalLM; "
                      "import turboquant_hf.kernels as k; print(k.__name__, callable(k.register))")
    assert r.returncode == 0 and r.stdout.split() == ["turboquant_hf.kernels", "True"], r.stderr


def test_load_from_root(tiny_llama_dir, tmp_path):
    """A checkpoint quantized here loads from the root with the same logits."""
    from transformers import AutoModelForCausalLM

    from turboquant_hf import TurboQuantConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, quantization_config=TurboQuantConfig(bits=4),
                                                 dtype=torch.bfloat16)
    saved = tmp_path / "tq4"
    model.save_pretrained(saved)
    ids = torch.arange(3, 19).view(1, -1)
    with torch.no_grad():
        want = model(ids).logits.float()
    torch.save(ids, tmp_path / "ids.pt")
    code = (f"import torch, turboquant_hf\nfrom transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(saved)!r}, dtype=torch.bfloat16)\n"
            f"with torch.no_grad():\n    y = m(torch.load({str(tmp_path / 'ids.pt')!r})).logits.float()\n"
            f"torch.save(y, {str(tmp_path / 'got.pt')!r})\n")
    r = _python("-c", code)
    assert r.returncode == 0, r.stderr
    assert torch.equal(torch.load(tmp_path / "got.pt"), want)
