"""eagle2_core: lossless EAGLE-2 speculative decoding on stock transformers models (no terminal code)."""
from .engine import Engine
from .events import GenerationSettings, StepEvent, Summary
from .head import DraftHead, HeadMismatchError, HeadSpec
from .treesettings import TreeSettings

__version__ = "0.1.0"
__all__ = ["Engine", "TreeSettings", "GenerationSettings", "StepEvent", "Summary", "DraftHead", "HeadMismatchError", "HeadSpec", "__version__"]
