"""eagle2_core: lossless EAGLE-2 speculative decoding on stock transformers models (no terminal code)."""
from __future__ import annotations

import importlib

from . import importtrims

importtrims.install()  # before anything imports transformers (importtrims.py: nothing they do changes)

# The package's names and the modules that define them, imported on first use: `import eagle2_core`
# (or of a light module of it, such as prompts) does not pay for torch and transformers' model code.
_EXPORTS = {"Engine": "engine", "GenerationSettings": "events", "StepEvent": "events",
            "Summary": "events", "DraftHead": "head", "HeadMismatchError": "head", "HeadSpec": "head",
            "TreeSettings": "treesettings"}

__version__ = "0.1.0"
__all__ = ["Engine", "TreeSettings", "GenerationSettings", "StepEvent", "Summary", "DraftHead", "HeadMismatchError", "HeadSpec", "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        # an AttributeError lets `from eagle2_core import module` fall back to importing the module
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
