"""eagle2_core: lossless EAGLE-2 speculative decoding on stock transformers models (no terminal code)."""
from .engine import Engine
from .events import GenerationSettings, StepEvent, Summary
from .head import DraftHead, HeadMismatchError, HeadSpec
from .treesettings import TreeSettings

Eagle2Decoder = Engine  # the name of earlier releases: the same engine

__version__ = "0.1.0"
__all__ = ["Engine", "Eagle2Decoder", "TreeSettings", "GenerationSettings", "StepEvent", "Summary", "DraftHead", "HeadMismatchError", "HeadSpec", "__version__"]
