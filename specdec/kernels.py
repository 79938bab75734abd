"""CPU linear kernels whose rows are independent: a k-row pass computes exactly what k one-row
passes compute, so a verify pass of k positions equals k single decoding steps bit for bit.

`Int8RowLinear` (`--quantize int8-rows`): int8 weights, one scale per output channel; int8
activations, one scale per row (symmetric: s_i = max|x_i| / 127, q_i = round(x_i / s_i)). The
product runs in fbgemm's int8 GEMM (`quantized::linear_dynamic`, the kernel behind
`quantize_dynamic`'s int8 path), which quantizes its input with ONE scale for the whole tensor,
the scale that makes int8 dynamic quantization row-dependent. Here its input is already integers,
and one more row, the sentinel, holds the int8 range's ends (-128 and 127, or -64 and 63 for
7-bit): fbgemm's scale for the tensor is then exactly 1.0 and its zero point exactly 128 (64), so
its quantization changes no value, its sums are integer sums (exact in any order), and its
epilogue multiplies each output by the same weight scale whatever the other rows hold. Each row
is then scaled by its own s_i and the bias added. Bitwise row-independent (tested).

Integer sums are exact only where the kernel does not saturate: without AVX-512 VNNI / AVX-VNNI,
fbgemm multiplies u8 x s8 pairs into int16 (vpmaddubsw), which saturates for 8-bit activations.
`activation_bits()` finds out once per process by running the kernel on extreme values against
an exact integer product: 8 bits where it is exact, else 7 (fbgemm's reduce_range, exact there).
"""

from __future__ import annotations

import functools
import warnings

import torch


def _prepack(weight: torch.Tensor) -> object:
    """fbgemm-packed int8 weight, one symmetric scale per output channel."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation warns of its deprecation
        qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)


@functools.cache
def activation_bits() -> int:
    """8 where fbgemm's int8 GEMM sums u8 x s8 products exactly on this CPU, else 7."""
    k, n = 64, 16
    w = torch.full((n, k), 127.0)
    w[1::2] = -127.0  # alternate signs across channels: both saturation directions
    packed = _prepack(w)
    x = torch.full((2, k), 127.0)
    x[1] = -128.0  # the sentinel row's two ends, as every call has them
    x[1, 1] = 127.0
    got = torch.ops.quantized.linear_dynamic(x, packed, False)
    exact = x.double() @ w.double().t()
    return 8 if torch.equal(got.double(), exact) else 7


_ROUND = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds a float32 below 2**22 to nearest even


def quantize_rows(rows: torch.Tensor, levels: float, out: torch.Tensor) -> torch.Tensor:
    """out = round(rows * (levels / max|row|)), each row's integers in [-levels, levels]; returns
    the per-row scales s ([n, 1]) with rows ~ out * s. Rounds half to even, as torch.round does,
    with two additions (torch.round was 14% of a 5-row pass)."""
    amax = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
    torch.mul(rows, levels / amax, out=out)
    out.add_(_ROUND).sub_(_ROUND)
    return amax.div_(levels)


class Int8RowLinear(torch.nn.Module):
    """A Linear with int8 weights (per output channel) and int8 activations (per row); see the
    module docstring. Inputs of any leading shape; float32 out."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = _prepack(linear.weight)
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(torch.float32, copy=True), requires_grad=False)
        bits = activation_bits()
        self._levels = 127.0 if bits == 8 else 63.0
        self._reduce_range = bits == 7
        sentinel = torch.zeros(1, self.in_features)
        sentinel[0, 0] = -self._levels - 1  # -128 (-64): with +127 (+63), fbgemm's scale is exactly 1
        sentinel[0, 1] = self._levels
        self.register_buffer("_sentinel", sentinel, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        n = rows.shape[0]
        q = torch.empty(n + 1, self.in_features)  # the rows' integers, then the sentinel
        s = quantize_rows(rows, self._levels, out=q[:n])
        q[n].copy_(self._sentinel[0])
        y = torch.ops.quantized.linear_dynamic(q, self._packed, self._reduce_range)
        y = y[:n].mul_(s)
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        bits = 8 if self._levels == 127.0 else 7
        return f"in_features={self.in_features}, out_features={self.out_features}, activations int{bits} per row"


class Int8Linear(torch.nn.Module):
    """fbgemm's int8 dynamic quantization (`--quantize int8`, a draft's default): int8 weights per
    output channel; the input quantized to 7 bits with ONE scale for all rows of a pass (fbgemm's
    reduce_range, exact on any x86), so a row's result depends on the others. Fastest at one row;
    for a draft, whose numerics never change the output."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._packed = _prepack(linear.weight)
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(torch.float32, copy=True), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.to(torch.float32), self._packed, True)
        return y if self.bias is None else y.add_(self.bias)


class Fp16Linear(torch.nn.Module):
    """fbgemm's fp16-weight kernel (`--quantize fp16`): fp16 weights, fp32 activations and
    accumulation; rows independent."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32, copy=True)
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().to(torch.float32), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.to(torch.float32), self._packed)


KERNELS = {"int8-rows": Int8RowLinear, "int8": Int8Linear, "fp16": Fp16Linear}


def replace_linears(model: torch.nn.Module, quantization: str) -> torch.nn.Module:
    """Replaces every CPU nn.Linear of the model by the module of `quantization` (a KERNELS key),
    in place, calling fbgemm's operators directly (torch.ao.quantization's module swapping is
    deprecated and warns)."""
    kernel = KERNELS[quantization]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.device.type == "cpu":
                setattr(parent, name, kernel(child))
    return model
