"""`x @ weight.T` for the handful of rows a draft tree puts through a product, at memory speed.

Speculative decoding turns one-row products (a plain decoding step) into few-row ones: the
verify pass has one row per tree node, each draft step one row per expanded node. On CPUs,
MKL/oneDNN's float32 `linear(x, W)` with a few rows can run far below memory speed, where
`W @ x.T` (a tall-skinny product that streams W through once) does not. On the 2-core AMD EPYC
(AVX2) development machine, SmolLM2's lm_head took 12 ms for one row with `linear` but 26-40 ms
for 2-32 rows, against 8-30 ms for `W @ x.T`; on a Zen 4 even the one-row `linear` was the slow
one (lm_head 10.1 ms for one row against 4.4 ms for two). So where the transposed form wins,
and up to how many rows, is not a constant: the cost profile measures it once per machine and
model (costs.measure_row_products) and installs the resulting `RowPlan` here; until one is
installed every product is a plain `linear`.

Only the order of the float32 additions changes, as it does between any one-row and multi-row
product (README: what "identical" means). Other dtypes and devices keep `linear`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

WIDE = 8192  # output features from which a weight counts as vocabulary-sized (a shape class, not a timing)


@dataclass(frozen=True)
class RowPlan:
    """Row counts at which `W @ x.T` was measured faster than `linear` on this machine, for
    body-sized and vocabulary-sized weights: one row where `*_one`, and 2 .. `*_max` rows (none
    where the max is below 2)."""
    body_one: bool = False
    body_max: int = 0
    wide_one: bool = False
    wide_max: int = 0

    def transposed(self, rows: int, out_features: int) -> bool:
        one, top = (self.wide_one, self.wide_max) if out_features >= WIDE else (self.body_one, self.body_max)
        return one if rows == 1 else 2 <= rows <= top

    def describe(self) -> str:
        def span(one: bool, top: int) -> str:
            lo = 1 if one else 2
            if top < 2:
                return "1 row" if one else "never"
            return f"{lo}-{top} rows"
        return f"body-sized weights {span(self.body_one, self.body_max)}, vocabulary-sized {span(self.wide_one, self.wide_max)}"


PLAN = RowPlan()  # nothing measured yet: `linear` everywhere


def install_plan(plan: RowPlan) -> None:
    """Make `plan` the one every product follows (costs.load_or_measure calls this)."""
    global PLAN
    PLAN = plan


@contextmanager
def using_plan(plan: RowPlan):
    """`plan` inside the block only (tests; measuring a profile under a trial plan)."""
    global PLAN
    before, PLAN = PLAN, plan
    try:
        yield
    finally:
        PLAN = before


def transposed_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Float32 on a CPU, inference, and a row count the installed plan measured faster transposed."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32:
        return False
    if weight.dim() != 2 or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return PLAN.transposed(rows, weight.shape[0])


def transposed_product(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x2 @ weight.T` for a 2-D `x2` as `(weight @ x2.T).T`, laid out as `linear` lays it out."""
    return torch.mm(weight, x2.t()).t().contiguous()  # contiguous: the next op reads along features


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `F.linear(x, weight, bias)` (up to float32 rounding), faster for few rows on CPU."""
    if not transposed_is_faster(x, weight):
        return F.linear(x, weight, bias)
    out = transposed_product(x.reshape(-1, x.shape[-1]), weight)
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class RowLinear(nn.Linear):
    """An `nn.Linear` whose forward is `linear_rows`: same parameters, same state_dict keys."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_rows(x, self.weight, self.bias)


def plain_linears(module: nn.Module) -> list[nn.Linear]:
    """The module's own `nn.Linear` layers (not quantized or other subclasses, which keep their forward)."""
    return [m for m in module.modules() if type(m) is nn.Linear]


def make_row_linears(module: nn.Module) -> nn.Module:
    """Turn a module we own (the draft head) into one whose plain linears use `linear_rows`."""
    for m in plain_linears(module):
        m.__class__ = RowLinear
    return module


@contextmanager
def row_linears(linears: list[nn.Linear]):
    """Route a model we do not own (the target) through `linear_rows` only inside the block, so
    the model object is unchanged for everything else, Hugging Face `generate` included."""
    try:
        for m in linears:
            m.forward = RowLinear.forward.__get__(m)
        yield
    finally:  # also after Ctrl-C mid-forward: the model must not keep our forward
        for m in linears:
            m.__dict__.pop("forward", None)
