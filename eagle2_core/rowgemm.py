"""`x @ weight.T` for the handful of rows a draft tree puts through a product, at memory speed.

Speculative decoding turns one-row products (a plain decoding step) into few-row ones: the
verify pass has one row per tree node, each draft step one row per expanded node. On CPUs,
MKL's float32 `linear(x, W)` with a few rows runs far below memory speed. Measured on the
2-core AMD EPYC (AVX2) development machine:
  * SmolLM2's lm_head (49,152 x 576): `linear` 12 ms for one row but 26-40 ms for any 2-32 rows;
    `W @ x.T` (a tall-skinny product that MKL streams W through once) 8 ms for 2 rows, 14 ms for
    10, 20 ms for 16, 30 ms for 32.
  * SmolLM2's decoder body (30 layers, no lm_head): one row 58 ms; 2-4 rows 95-101 ms with
    `linear`, 66-72 ms with `W @ x.T`; 6-8 rows 89-99 vs 83 ms; from 10 rows on the two tie.
Only the order of the float32 additions changes, as it does between any one-row and multi-row
product (README: what "identical" means). Other dtypes and devices keep `linear`.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 8             # body-sized weights: above this `linear` is as fast
MAX_ROWS_WIDE = 64       # vocabulary-sized weights (lm_head): the transposed form wins up to here
WIDE = 8192              # output features from which a weight counts as vocabulary-sized


def transposed_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Float32 on a CPU, inference, 2..MAX_ROWS rows: where `W @ x.T` beats `linear` (measured)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != torch.float32:
        return False
    if weight.dim() != 2 or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return 2 <= rows <= (MAX_ROWS_WIDE if weight.shape[0] >= WIDE else MAX_ROWS)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same result as `F.linear(x, weight, bias)` (up to float32 rounding), faster for few rows on CPU."""
    if not transposed_is_faster(x, weight):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, x2.t()).t().contiguous()  # contiguous: the next op reads along features
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
