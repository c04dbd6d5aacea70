"""Start-up trims of what importing transformers costs, none of which changes what it does.

Most of a first answer's time on a CPU is imports (torch, then transformers' model code). Two
parts of transformers' are work no eagle2 command uses, done at import:

- transformers makes its lazy import structure by walking its `models` folder (every model's
  folder, every file's text read) once for the top-level package and again for
  `transformers.models`. The walk's `lru_cache` holds fewer folders than it walks, so the second
  walk finds none of the first's: with an unbounded cache (the same function, the same results)
  it is one folder's listing.
- transformers' loss modules import `scipy.optimize` at import for one function (the Hungarian
  matching of object detection's losses). That name is bound to a forwarder that imports scipy
  when first called; `scipy.optimize` imported by anything else is scipy's own, as before.

`install` (from `eagle2_core`'s __init__, before anything imports transformers) puts a finder
first on `sys.meta_path` that acts on those modules only and otherwise defers to the rest.
EAGLE2_IMPORT_TRIMS=0 leaves the import system alone. Loading torch's compiler
(`torch._dynamo`) and distributed packages, which transformers' modules also import, is not
trimmed: they run decorators and make objects of those packages at import.
"""
from __future__ import annotations

import functools
import importlib.abc
import os
import sys

_LOSS_PACKAGE = "transformers.loss"
_SCIPY_NAMES = ("linear_sum_assignment",)


def _unbounded_scan_cache(module) -> None:
    """After transformers.utils.import_utils runs: its folder walk cached without a bound."""
    scan = getattr(module, "create_import_structure_from_path", None)
    inner = getattr(scan, "__wrapped__", None)
    if inner is not None and hasattr(scan, "cache_info") and scan.cache_info().maxsize is not None:
        # the walk recurses through the module's global name, so every level uses the new cache
        module.create_import_structure_from_path = functools.lru_cache(maxsize=None)(inner)


class _Forwarding(type(sys)):
    """`scipy.optimize` as transformers' loss modules import it: each name a forwarder to scipy's own."""

    def __getattr__(self, name):
        if name in _SCIPY_NAMES:
            def forward(*args, **kwargs):
                return getattr(_real_scipy_optimize(), name)(*args, **kwargs)
            forward.__name__ = forward.__qualname__ = name
            setattr(self, name, forward)
            return forward
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(_real_scipy_optimize(), name)


def _real_scipy_optimize():
    if isinstance(sys.modules.get("scipy.optimize"), _Forwarding):  # called while a loss module imports
        del sys.modules["scipy.optimize"]
    import scipy.optimize

    return scipy.optimize


class _Around(importlib.abc.Loader):
    """A module's own loader, with `before(module)` and `after(module)` around the module's code."""

    def __init__(self, loader, before, after):
        self._loader, self._before, self._after = loader, before, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        token = self._before(module)
        try:
            self._loader.exec_module(module)
        finally:
            self._after(module, token)

    def __getattr__(self, name):  # get_source, get_filename, is_package...: the module's own loader's
        return getattr(self._loader, name)


def _stand_in(module):
    """Before a module of transformers' loss package runs: scipy.optimize as forwarders, where
    scipy.optimize is not imported yet."""
    if "scipy.optimize" in sys.modules:
        return None
    stand_in = sys.modules["scipy.optimize"] = _Forwarding("scipy.optimize")
    stand_in.__doc__ = "eagle2's stand-in for scipy.optimize while a transformers loss module imports (eagle2_core.importtrims)"
    return stand_in


def _drop_stand_in(module, stand_in) -> None:
    """After it: later imports of scipy.optimize get scipy's own."""
    if stand_in is not None and sys.modules.get("scipy.optimize") is stand_in:
        del sys.modules["scipy.optimize"]


def _nothing(module):
    return None


def _hooks(name: str):
    """(before, after) for a module the finder acts on, else None."""
    if name == "transformers.utils.import_utils":
        return _nothing, lambda module, _: _unbounded_scan_cache(module)
    if name.startswith(_LOSS_PACKAGE + "."):
        return _stand_in, _drop_stand_in
    return None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        hooks = _hooks(name)
        if hooks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Around(spec.loader, *hooks)
                return spec
        return None


def install() -> None:
    """Put the finder first on sys.meta_path (once; not with EAGLE2_IMPORT_TRIMS=0)."""
    if os.environ.get("EAGLE2_IMPORT_TRIMS", "1") == "0" or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is not None:  # transformers imported already: its second walk (transformers.models) may still be due
        _unbounded_scan_cache(utils)
