"""GPU implementations of the `turboquant` torch ops (installed as `turboquant_hf.kernels`; `registry` registers them).

This folder sits at the top of the checkout, where Python also finds it as a top-level package named `kernels`
whenever the checkout's root is on `sys.path` (any `python` started there). That name belongs to another
distribution, which transformers imports; imported under it, this file hands the import to the installed
`kernels` package and defines nothing of its own. Where that package is not installed, the module stays what a
folder without `__init__.py` would be (an empty namespace package: no `__file__`, no version), which is what
transformers' availability check (`_is_package_available`) reads as "not installed".
"""

if __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is None:
        __file__ = None
        __path__ = []
        del _machinery, _util, _os, _sys, _root, _spec
    else:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # (the import statement returns what sys.modules holds after this file)
        _spec.loader.exec_module(_module)
else:
    from .registry import register, registered  # noqa: F401  (importing registry registers the kernels)

    __all__ = ["register", "registered"]
