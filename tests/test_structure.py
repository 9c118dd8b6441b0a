"""The package's shape: no import cycle (function-local imports included), imports that run down the layers only,
no module or function too large to read."""

from __future__ import annotations

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"turboquant_hf": os.path.join(ROOT, "turboquant_hf"), "turboquant_hf.kernels": os.path.join(ROOT, "kernels")}
# The layers, lowest first: a module imports only from its own layer or one below it. Each entry names a folder of
# the package (or top-level modules: `turboquant_hf` stands for the package's `__init__`, `__main__` and the
# modules kept at their old paths) and says why it sits there.
LAYERS = [
    (("settings",), "environment switches, read by every layer; imports nothing of the package"),
    (("format",), "the on-disk format and the codec in plain torch: no module, no model, no transformers"),
    (("modeling", "kernels"), "the operators, their CPU and GPU implementations and the modules that call them"),
    (("quantization",), "what to quantize: configs, recipes and the per-module plans of TurboQuant modules"),
    (("calibration",), "rounding chosen from data, for the modules a plan names"),
    (("reporting",), "sizes, memory plans, model card and quality of a model or a saved folder"),
    (("integration",), "transformers' hooks, which load, calibrate, save and describe models through the layers below"),
    (("conversion",), "offline conversion, which reads MLX checkpoints as the integration does and calibrates"),
    (("cli", "turboquant_hf"), "the entry points: the command line uses the package as a user does"),
]
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 120
MAX_KERNEL_LINES = 200  # one @triton.jit body


def _modules() -> dict[str, str]:
    """Every module of the package, subfolders included, by its dotted name."""
    out = {}
    for package, top in PACKAGES.items():
        for folder, dirs, names in os.walk(top):
            dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
            sub = os.path.relpath(folder, top).replace(os.sep, ".")
            prefix = package if sub == "." else f"{package}.{sub}"
            for name in sorted(names):
                if name.endswith(".py"):
                    stem = name[:-3]
                    out[prefix if stem == "__init__" else f"{prefix}.{stem}"] = os.path.join(folder, name)
    return out


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    """Modules of the package that `module` imports anywhere in its file (top level or inside functions).

    `from pkg import name` where `name` is no module counts as an import of `pkg` itself (its `__init__`)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from . import x` names the submodule x; `from .x import y` the module x; `from pkg import Name` pkg
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module:
                found.add(n)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycle():
    graph = _graph()
    assert "turboquant_hf.quantization.planning" in graph and graph["turboquant_hf.integration.quantizer"]
    assert _cycles(graph) == []


def test_imports_inside_functions_and_of_package_names_are_edges(tmp_path):
    """The walk sees an import in a function body, a relative import of a sibling package's submodule, and a name
    taken from a package's `__init__` (an edge to the package: its `__init__` runs that import's module)."""
    path = tmp_path / "moe.py"
    path.write_text("import torch\n\n\ndef f():\n    from turboquant_hf.modeling import ops\n"
                    "    from .. import TurboQuantConfig\n"
                    "    from . import linear\n    return ops, linear, TurboQuantConfig, torch\n")
    known = {"turboquant_hf", "turboquant_hf.modeling.ops", "turboquant_hf.kernels", "turboquant_hf.kernels.linear",
             "turboquant_hf.kernels.moe"}
    found = _imports("turboquant_hf.kernels.moe", str(path), known)
    assert found == {"turboquant_hf", "turboquant_hf.modeling.ops", "turboquant_hf.kernels.linear"}
    # a kernel module that reaches back into a module importing it is a cycle, function-local or not
    graph = _graph()
    graph["turboquant_hf.modeling.modules"].add("turboquant_hf.kernels.moe")
    graph["turboquant_hf.kernels.moe"].add("turboquant_hf.modeling.modules")
    assert _cycles(graph)


def test_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _layer(module: str) -> int:
    """The index in LAYERS of a module's folder (top-level modules: `settings` or the package itself)."""
    parts = module.split(".")
    unit = parts[1] if len(parts) > 1 and any(parts[1] in units for units, _ in LAYERS) else parts[0]
    for i, (units, _) in enumerate(LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"{module}: its folder {unit!r} has no place in LAYERS")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if _layer(d) > _layer(m))


def test_imports_run_down_the_layers():
    graph = _graph()
    assert {_layer(m) for m in graph} == set(range(len(LAYERS)))  # every folder placed, every layer used
    assert _upward(graph) == []


def test_an_import_of_a_higher_layer_is_found():
    graph = _graph()
    graph["turboquant_hf.format.codec"].add("turboquant_hf.integration.quantizer")
    graph["turboquant_hf.kernels.moe"].add("turboquant_hf.quantization.planning")
    assert _upward(graph) == ["turboquant_hf.format.codec -> turboquant_hf.integration.quantizer",
                              "turboquant_hf.kernels.moe -> turboquant_hf.quantization.planning"]
    assert _layer("turboquant_hf.settings") < _layer("turboquant_hf.format.constants") < _layer("turboquant_hf.cli")
    assert _layer("turboquant_hf.lora") == _layer("turboquant_hf") == _layer("turboquant_hf.cli.commands")
    assert _layer("turboquant_hf.format") == _layer("turboquant_hf.format.codec") < _layer("turboquant_hf.kernels")


# the modules a user could import at their old, flat paths: the same module objects as their homes
KEPT_PATHS = {"config": "quantization.config", "modules": "modeling.modules", "ops": "modeling.ops",
              "codec": "format.codec", "checkpoint": "format.checkpoint", "recipes": "quantization.recipes",
              "quantizer": "integration.quantizer", "lora": "integration.lora", "evaluation": "reporting.evaluation",
              "streaming": "conversion.streaming"}


@pytest.mark.parametrize("old", sorted(KEPT_PATHS))
def test_old_paths_are_the_modules(old):
    if old == "lora":
        pytest.importorskip("peft")
    module = importlib.import_module(f"turboquant_hf.{old}")
    assert module is importlib.import_module(f"turboquant_hf.{KEPT_PATHS[old]}")
    import turboquant_hf

    assert getattr(turboquant_hf, old) is module  # (after `import turboquant_hf`, as before for those it imported)


def test_old_package_names():
    import turboquant_hf
    from turboquant_hf.calibration import calibrate_model, rtn_quantize
    from turboquant_hf.calibration.sequential import calibrate_model as home
    from turboquant_hf.calibration.sequential import rtn_quantize as rtn_home
    from turboquant_hf.format import constants

    assert turboquant_hf.format.codebook is constants.codebook and turboquant_hf.format.TERNARY == constants.TERNARY
    assert calibrate_model is home is turboquant_hf.calibrate_model and rtn_quantize is rtn_home


def _functions(path: str):
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
            yield node.name, node.end_lineno - node.lineno + 1, jit


@pytest.mark.parametrize("module", sorted(_modules()))
def test_module_and_function_sizes(module):
    path = _modules()[module]
    with open(path, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_MODULE_LINES, f"{path}: {lines} lines"
    for name, length, jit in _functions(path):
        limit = MAX_KERNEL_LINES if jit else MAX_FUNCTION_LINES
        assert length <= limit, f"{path}: {name} is {length} lines"
