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

The native backend (`specdec/csrc/int8_rows.c`, used wherever it builds: x86-64 with AVX2 and a C
compiler) computes the same formula with 8-bit activations on every AVX2 CPU (its u8 x s8 pairs
cannot saturate: |x| <= 127 and the weight carries x's sign), quantizes the rows itself and skips
fbgemm's per-call work (its dynamic quantization of an input that is already integers, the
sentinel row, the torch ops around it): on this 2-core AVX2 VM a 256x1536 projection costs 0.015
ms a row against fbgemm's 0.19, a 1536x8960 one 0.60 against 0.94 (docs/benchmarks/native-int8/).
On CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later) the same library runs its products with
vpdpbusd instead (chosen at run time; `SPECDEC_NATIVE_ISA=avx2` keeps the AVX2 path): the same
integer sums, so the same output bits (tested), and 1.3x faster at 5 rows, 1.5-2.1x at 9-32 rows, the
same at 1-2 rows, where reading the weights is the bound (one 1536x8960 projection, 2 cores).
It is compiled once per source into the cache (`native_library`); `SPECDEC_NATIVE_KERNELS=0`
turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "int8_rows.c"
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]


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


def _native_wanted() -> bool:
    """Not turned off (SPECDEC_NATIVE_KERNELS=0: the fbgemm path, as before the native kernel)."""
    return os.environ.get("SPECDEC_NATIVE_KERNELS", "1") != "0"


def _library_name() -> str:
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    return f"int8_rows-{digest}.so"


def build_native(directory: Path) -> Path | None:
    """Compiles specdec/csrc/int8_rows.c into `directory` (named by the source's and flags' hash)
    unless it is there; the library's path, or None (logged) where no compiler builds it. Written
    to a temporary name and renamed: workers starting together each see a whole library."""
    target = Path(directory) / _library_name()
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: int8-rows runs on fbgemm (slower; set CC to build the native kernel)")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([compiler, *_CFLAGS, str(_SOURCE), "-o", str(built)], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("the native int8-rows kernel did not build (int8-rows runs on fbgemm): %s",
                        done.stderr.strip()[-2000:])
            return None
        os.replace(built, target)
    return target


@functools.cache
def native_library() -> ctypes._CFuncPtr | None:
    """The native int8-rows kernel (specdec/csrc/int8_rows.c), loaded from beside its source where
    an image built it there (the Dockerfile: `python -m specdec.kernels`), else compiled on first
    use into `<cache root>/kernels/`; None where it cannot run here (no AVX2, not Linux x86-64, no
    C compiler) or fails to build (logged, and every Int8RowLinear then uses fbgemm). torch is
    imported first, so the library's libgomp.so.1 is the one torch loaded: its parallel regions
    run on torch's threads."""
    if not (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        return None
    from specdec.model_store import cache_root

    shipped = _SOURCE.with_name(_library_name())
    path = shipped if shipped.exists() else build_native(cache_root() / "kernels")
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    fn = lib.specdec_int8_rows_linear
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int32]
    fn.restype = ctypes.c_int
    lib.specdec_native_isa.argtypes = [ctypes.c_int32]
    lib.specdec_native_isa.restype = ctypes.c_int
    # AVX-512 VNNI where the CPU has it (the same integers, so the same bits), unless
    # SPECDEC_NATIVE_ISA=avx2 keeps the AVX2 path (the ablation; the tests compare the two)
    isa_names, wants = {1: "avx2", 2: "avx512-vnni"}, {"best": 0, "avx2": 1}
    fn.set_isa = lambda want: isa_names[lib.specdec_native_isa(wants[want])]  # the ISA now in use
    fn.isa = fn.set_isa("avx2" if os.environ.get("SPECDEC_NATIVE_ISA", "").lower() == "avx2" else "best")
    int4 = lib.specdec_int4_rows_linear
    int4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
    int4.restype = ctypes.c_int
    fn.int4 = int4  # the library's second kernel (Int4RowLinear)
    return fn


def native_available() -> bool:
    """Whether Int8RowLinear runs on the native kernel here (it builds, and is not turned off)."""
    return _native_wanted() and native_library() is not None


def int8_channels(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weights [N, K] and their float32 scales [N]: one symmetric scale per output channel,
    max|w| / 127, integers in [-127, 127]."""
    w = weight.detach().to(torch.float32)
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale.contiguous()


_TILE, _COLUMNS = 4, 32  # int8_rows.c's TILE, and its columns per vector


def native_tiles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weights in the native kernel's layout: N and K zero-padded to multiples of 4 and
    32, then [N / 4][K / 32][4][32] (each tile of 4 channels one sequential stream), flat and
    32-byte aligned."""
    n, k = q.shape
    np_, kp = -(-n // _TILE) * _TILE, -(-k // _COLUMNS) * _COLUMNS
    padded = torch.zeros(np_, kp, dtype=torch.int8)
    padded[:n, :k] = q
    tiles = padded.view(np_ // _TILE, _TILE, kp // _COLUMNS, _COLUMNS).transpose(1, 2).reshape(-1)
    flat = torch.empty(tiles.numel() + 32, dtype=torch.int8)
    start = (-flat.data_ptr()) % 32
    return flat[start:start + tiles.numel()].copy_(tiles)


class Int8RowLinear(torch.nn.Module):
    """A Linear with int8 weights (per output channel) and int8 activations (per row); see the
    module docstring. Inputs of any leading shape; float32 out. `native`: None picks the native
    kernel where it builds, else fbgemm."""

    def __init__(self, linear: torch.nn.Linear, native: bool | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(torch.float32, copy=True), requires_grad=False)
        self._native = native_library() if native or (native is None and _native_wanted()) else None
        if native and self._native is None:
            raise RuntimeError("the native int8-rows kernel is not available on this machine")
        if self._native is not None:
            self._levels = 127.0
            weight, scale = int8_channels(linear.weight)
            self._columns = -(-self.in_features // _COLUMNS) * _COLUMNS
            self.register_buffer("_weight", native_tiles(weight), persistent=False)
            wsum = torch.zeros(-(-self.out_features // _TILE) * _TILE, dtype=torch.int32)
            wsum[:self.out_features] = weight.sum(dim=1, dtype=torch.int32)  # the VNNI path's offsets
            self.register_buffer("_wsum", wsum, persistent=False)
            self.register_buffer("_scale", scale, persistent=False)
            return
        self._packed = _prepack(linear.weight)
        bits = activation_bits()
        self._levels = 127.0 if bits == 8 else 63.0
        self._reduce_range = bits == 7
        sentinel = torch.zeros(1, self.in_features)
        sentinel[0, 0] = -self._levels - 1  # -128 (-64): with +127 (+63), fbgemm's scale is exactly 1
        sentinel[0, 1] = self._levels
        self.register_buffer("_sentinel", sentinel, persistent=False)

    @property
    def backend(self) -> str:
        return "native" if self._native is not None else "fbgemm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        n = rows.shape[0]
        if self._native is not None:
            if n == 0:
                return rows.new_empty(*shape[:-1], self.out_features)
            rows = rows.contiguous()
            y = torch.empty(n, self.out_features)
            if self._native(rows.data_ptr(), n, self.in_features, self._weight.data_ptr(), self._columns,
                            self.out_features, self._wsum.data_ptr(), self._scale.data_ptr(),
                            None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                            torch.get_num_threads()) != 0:
                raise MemoryError("int8-rows: no scratch memory for the quantized rows")
            return y.reshape(*shape[:-1], self.out_features)
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
        return (f"in_features={self.in_features}, out_features={self.out_features}, activations int{bits} per row, "
                f"{self.backend}")


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


@functools.cache
def fp16_rows_independent() -> bool:
    """Whether fbgemm's fp16-weight GEMM gives each row the bits it gives that row alone, on this
    CPU. It does with AVX-512 (measured on an AVX-512 EPYC: 9-row passes equal 9 steps); with
    AVX2 only (a Zen 3 EPYC) a 2-row product differs from its rows alone in the last bits, so
    there an fp16 target's verify pass is not exactly k single steps and speculative greedy
    output can leave the target's own on a near-tie. The workers warn at load."""
    g = torch.Generator().manual_seed(0)
    m = Fp16Linear(torch.nn.Linear(256, 384))
    x = torch.randn(9, 256, generator=g)
    return all(torch.equal(m(x[:r]), torch.cat([m(x[i:i + 1]) for i in range(r)])) for r in (2, 5, 9))


class Fp16Linear(torch.nn.Module):
    """fbgemm's fp16-weight kernel (`--quantize fp16`): fp16 weights, fp32 activations and
    accumulation; rows independent where `fp16_rows_independent()` (AVX-512 CPUs), not on AVX2."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().to(torch.float32, copy=True)
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().to(torch.float32), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.to(torch.float32), self._packed)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A flat copy of `t` whose data starts on a 32-byte boundary."""
    flat = torch.empty(t.numel() * t.element_size() + 32, dtype=torch.uint8)
    start = (-flat.data_ptr()) % 32
    return flat[start:start + t.numel() * t.element_size()].view(t.dtype).copy_(t.reshape(-1))


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Affine 4-bit weights per group of 32 columns (K padded to a multiple of 32): u [N, Kp]
    in 0..15 (uint8), d and m [N, Kp / 32] float32 with w ~ d * u + m, and the share of groups
    whose values lie on such a grid already.

    Weights dequantized from 4-bit GGUF blocks (Q4_K: 32-column sub-blocks, w = d_j q - m_j)
    are on a grid of at most 16 evenly spaced values per group, whose ends need not be used.
    For each group the step is the smallest gap between its values, kept where every value
    then lies within 0.02 steps (plus float16 rounding) of a grid point of at most 16 levels,
    so such weights come back as the GGUF's own levels, up to the float16 rounding of the
    store. Other groups take min..max in 15
    steps."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    kp = -(-k // _COLUMNS) * _COLUMNS
    if kp != k:  # padded with each row's last weight, on its group's grid (the padding meets zeros)
        w = torch.cat([w, w[:, k - 1:].expand(n, kp - k)], dim=1)
    us, ds, los, on_grid = [], [], [], 0
    for rows in w.split(4096):  # bounded temporaries (the default target's head has 151,936 rows)
        u, d, lo, fits = _grid_rows(rows.reshape(rows.shape[0], kp // _COLUMNS, _COLUMNS))
        us.append(u.view(rows.shape[0], kp)), ds.append(d), los.append(lo)
        on_grid += int(fits.sum())
    return torch.cat(us), torch.cat(ds).contiguous(), torch.cat(los).contiguous(), on_grid / (n * (kp // _COLUMNS))


def _grid_rows(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_groups for groups g [rows, G, 32]: the step is the smallest gap between a group's
    sorted values (any two neighbouring levels present give it), checked against every value."""
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    spread = hi - lo
    slack = (g.abs() + lo.abs()[..., None]) * 2.0 ** -11  # float16 rounding of a value and of the minimum
    gaps = g.sort(dim=2).values.diff(dim=2)
    gaps = torch.where(gaps > 4 * slack[..., 1:], gaps, torch.full_like(gaps, float("inf")))  # equal values
    gap = gaps.amin(dim=2)
    fits = torch.zeros_like(spread, dtype=torch.bool)
    d = spread / 15.0  # off any grid: min..max in 15 steps
    for parts in (1, 2, 3):  # no two neighbouring levels present: the smallest gap is 2 or 3 steps
        span = torch.round(spread / gap * parts)
        ok = torch.isfinite(gap) & (span >= 1) & (span <= 15) & ~fits
        step = torch.where(ok, spread / span.clamp(min=1), torch.ones_like(spread))
        t = (g - lo[..., None]) / step[..., None]
        ok &= ((t - torch.round(t)).abs() * step[..., None] <= 0.02 * step[..., None] + slack).all(dim=2)
        d = torch.where(ok, step, d)
        fits |= ok
    d = torch.where(spread > 0, d, torch.ones_like(d))
    u = torch.round((g - lo[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8)
    return u, d, lo, fits | (spread <= 0)



class Int4RowLinear(torch.nn.Module):
    """`--quantize int4-rows`: 4-bit weights, affine per group of 32 columns (half int8-rows'
    weight bytes), int8 activations per row, integer sums per group and one fixed float order
    per row: rows bitwise independent, as int8-rows. Native kernel only (specdec/csrc/int8_rows.c)."""

    def __init__(self, linear: torch.nn.Linear, groups: tuple | None = None):
        """groups: int4_groups(linear.weight), where the caller computed it already."""
        super().__init__()
        lib = native_library()
        if lib is None:
            raise RuntimeError("int4-rows needs the native kernel (Linux x86-64 with AVX2 and a C compiler)")
        self._kernel = lib.int4
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(
            linear.bias.detach().to(torch.float32, copy=True), requires_grad=False)
        u, d, m, _ = groups if groups is not None else int4_groups(linear.weight)
        n, kp = u.shape
        groups, np_ = kp // _COLUMNS, -(-n // _TILE) * _TILE
        self._columns = kp
        pad = np_ - n
        u = torch.nn.functional.pad(u, (0, 0, 0, pad))
        d = torch.nn.functional.pad(d, (0, 0, 0, pad), value=1.0)
        m = torch.nn.functional.pad(m, (0, 0, 0, pad))
        g = u.view(np_, groups, 2, 16)
        packed = (g[:, :, 0] | (g[:, :, 1] << 4)).view(np_ // _TILE, _TILE, groups, 16).transpose(1, 2)
        self.register_buffer("_weight", _aligned(packed.contiguous().view(torch.int8)), persistent=False)
        self.register_buffer("_scale", d.view(np_ // _TILE, _TILE, groups).transpose(1, 2).contiguous().view(-1),
                             persistent=False)
        self.register_buffer("_offset", m.contiguous().view(-1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        n = rows.shape[0]
        if n == 0:
            return rows.new_empty(*shape[:-1], self.out_features)
        y = torch.empty(n, self.out_features)
        if self._kernel(rows.data_ptr(), n, self.in_features, self._weight.data_ptr(), self._columns,
                        self.out_features, self._scale.data_ptr(), self._offset.data_ptr(),
                        None if self.bias is None else self.bias.data_ptr(), y.data_ptr(),
                        torch.get_num_threads()) != 0:
            raise MemoryError("int4-rows: no scratch memory for the quantized rows")
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, 4-bit weights per 32 columns"


ON_GRID = 0.99  # int4-rows: the share of a weight's groups on a 4-bit grid for it to be held in 4 bits


def int4_where_on_grid(linear: torch.nn.Linear) -> torch.nn.Module:
    """`--quantize int4-rows`, per Linear: Int4RowLinear where the weight is already on 4-bit grids
    (ON_GRID of its groups: weights from Q4_K blocks, whose levels it keeps exactly), else
    Int8RowLinear (weights from 6-bit blocks, such as the default target's output head and some
    of its attn_v / ffn_down tensors, would lose to 4 bits). Rows independent either way."""
    groups = int4_groups(linear.weight)
    if groups[3] >= ON_GRID:
        return Int4RowLinear(linear, groups)
    return Int8RowLinear(linear)


KERNELS = {"int8-rows": Int8RowLinear, "int4-rows": int4_where_on_grid, "int8": Int8Linear, "fp16": Fp16Linear}


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


if __name__ == "__main__":  # python -m specdec.kernels: build the native kernel beside its source (images)
    import sys

    logging.basicConfig(level=logging.INFO)
    sys.exit(0 if build_native(_SOURCE.parent) is not None else 1)
