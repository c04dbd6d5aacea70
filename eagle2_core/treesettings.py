"""The draft tree's settings, and which tree each device gets by default.

`TreeSettings` is what a decoder is asked to draft; `device_trees` is the default policy that
`Runtime.load` applies: the per-cycle budget (`budget="auto"`, budget.py) where a cost profile
was measured (a CPU) and the tree is dynamic and uncaptured, a constant budget elsewhere (a GPU,
captured cycles) or on request. Pure: no model is touched here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

AUTO_MAX_CPU, AUTO_MAX_GPU = 16, 60  # the largest tree `--total-tokens auto` may choose
AUTO_DEPTH_CPU = 4  # the deepest expansion there; each cycle stops where deeper levels stop paying (budget.py)
# A prompt file's batched trees (Runtime.batch_decoder, `eagle2 tune --batch`) expand this deep and
# this wide unless given: the batch cost grid (costs.BatchCosts) is measured for one expansion,
# and its trees are small (costs.BATCH_TREES), so a shallow, narrow one fills them.
BATCH_DEPTH, BATCH_TOP_K = 3, 2


@dataclass
class TreeSettings:
    """Shape of the draft tree. `depth` is the longest draft path (tokens after the root).

    Defaults are for a float32 target on a CPU, where every extra verify row and draft step costs
    real time, so small trees win; the paper's GPU setting is total_tokens=60, depth=6, top_k=10
    (`TreeSettings.gpu()`), which matches the reference code's depth=5 expansion steps. The
    sweeps behind these sizes: docs/benchmarks.md.
    """
    shape: str = "dynamic"          # dynamic | static | chain
    total_tokens: int = 4           # tree size including the root (the verify batch)
    depth: int = 2
    top_k: int = 2
    expand_by: str = "path"         # path (EAGLE-2) | node (ablation: the node's own confidence)
    rerank: bool = True             # False: ablation, keep the expanded nodes breadth-first
    budget: str = "constant"        # constant: total_tokens every cycle; auto: per cycle, up to total_tokens,
                                    # from the draft's confidence and the measured costs (budget.py)

    @classmethod
    def gpu(cls) -> "TreeSettings":
        return cls(total_tokens=60, depth=6, top_k=10)

    @classmethod
    def cpu_half(cls) -> "TreeSettings":
        """A half-precision target on a CPU whose measured lm_head costs about the same for 16 rows
        as for the two-pass plan (AMX tiles, AVX512-BF16): a larger tree pays there."""
        return cls(total_tokens=10, depth=3, top_k=4)

    @classmethod
    def for_device(cls, device, dtype: torch.dtype | None = None, costs=None) -> "TreeSettings":
        """The default tree with a constant budget: the GPU's, and on a CPU the one `--total-tokens N`,
        graph mode and `tree:` sweeps start from (a CPU's default is the per-cycle budget,
        `Runtime.auto_tree`). With a half-precision CPU target it follows the measured cost
        profile (`costs.CostProfile.rows_are_cheap`): no rule per CPU family."""
        kind = torch.device(device).type
        if kind == "cuda":
            return cls.gpu()
        if kind != "cpu":
            return cls.cpu_half()  # mps and other accelerators: extra rows are nearly free
        if dtype in (torch.bfloat16, torch.float16) and costs is not None and costs.rows_are_cheap(16):
            return cls.cpu_half()
        # float32 on any CPU (rowgemm makes rows cheaper, but each still costs), and half
        # precision where each row of a product costs in full (measured)
        return cls()

    def label(self) -> str:
        """`dynamic 4/2/2` (tokens/depth/top-k), or `auto (up to 16, depth 4, top-k 4)` with the per-cycle budget."""
        if self.budget == "auto" and self.shape == "dynamic":
            return f"auto (up to {self.total_tokens}, depth {self.depth}, top-k {self.top_k})"
        return f"{self.shape} {self.total_tokens}/{self.depth}/{self.top_k}"

    def validate(self) -> None:
        if self.shape not in ("dynamic", "static", "chain"):
            raise ValueError(f"draft shape must be dynamic, static or chain, not {self.shape!r}")
        if self.total_tokens < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError("total_tokens must be >= 2, depth >= 1 and top_k >= 1")
        if self.expand_by not in ("path", "node"):
            raise ValueError(f"expand_by must be path or node, not {self.expand_by!r}")
        if self.budget not in ("constant", "auto"):
            raise ValueError(f"budget must be constant or auto, not {self.budget!r}")


def auto_max(device) -> int:
    """The largest tree `--total-tokens auto` may choose on this device."""
    return AUTO_MAX_GPU if torch.device(device).type == "cuda" else AUTO_MAX_CPU


def device_trees(device, dtype, costs, tree: dict, compile: bool | None = None) -> tuple[TreeSettings, TreeSettings, TreeSettings]:
    """(the tree to run, the per-cycle budget's settings, the constant-budget tree) for a target on
    `device` in `dtype`, given the measured `costs` (None off a CPU) and the user's `tree` fields
    (None: not given; `total_tokens` may be "auto"). Raises ValueError for settings out of range."""
    base = TreeSettings.for_device(device, dtype, costs)
    given = {k: v for k, v in tree.items() if v is not None and k != "total_tokens"}
    auto = dataclasses.replace(base, **{**given, "budget": "auto", "shape": "dynamic",
                                        "total_tokens": max(base.total_tokens, auto_max(device))})
    if costs is not None:
        # On a CPU the expansion follows the measured profile too, unless given: its width is
        # the widest draft step that costs about what the cheapest does (costs.draft_width).
        auto = dataclasses.replace(auto, top_k=tree.get("top_k") or costs.draft_width(), depth=tree.get("depth") or AUTO_DEPTH_CPU)
    constant_tree = dataclasses.replace(base, **{k: v for k, v in tree.items() if v is not None and v != "auto"})
    # The per-cycle budget is the default where a cost profile was measured (a CPU) and the
    # tree is dynamic; a constant budget stays on request, for captured cycles (graph mode) and
    # on a GPU, where the cycle runs captured in graph mode.
    default_auto = costs is not None and tree.get("total_tokens") is None and constant_tree.shape == "dynamic" and not compile
    settings = auto if tree.get("total_tokens") == "auto" or default_auto else constant_tree
    settings.validate()
    auto.validate()
    constant_tree.validate()
    return settings, auto, constant_tree
