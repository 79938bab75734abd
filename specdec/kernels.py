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
sentinel row, the torch ops around it), so it is faster than fbgemm, most on small projections
(docs/benchmarks/native-int8/). On CPUs with AVX-512 VNNI (Zen 4, Ice Lake and later) the same
library runs its products with vpdpbusd instead (chosen at run time; `SPECDEC_NATIVE_ISA=avx2`
keeps the AVX2 path): the same integer sums, so the same output bits (tested), faster where a
pass is compute-bound (5 rows and more) and the same at 1-2 rows, where reading the weights is the
bound (docs/benchmarks/native-int8/).
It is compiled once per source into the cache (`native_library`); `SPECDEC_NATIVE_KERNELS=0`
turns it off.

`Q4KRowLinear` (`--quantize int4-rows`, the CPU target's default where the native kernel builds):
for each Linear whose weight the model's source GGUF holds in Q4_K blocks, those very blocks (the
numbers llama.cpp computes with; modeling.gguf_blocks reads them and checks them against the store),
against the same int8 activations per row, with integer sums per 256-column super-block and one
fixed float order per row and channel: rows bitwise independent, and ~0.58 bytes a weight read
instead of 1. `Q6KRowLinear` does the same for each Linear the GGUF holds in Q6_K blocks (the
default target's head and half its attention values and MLP outputs: ~0.83 bytes a weight where
int8-rows requantizes them to 1; SPECDEC_Q6K=0 keeps those int8-rows, the ablation). Every other
Linear stays int8-rows.

The native kernels' weights live in `weight_memory`: anonymous mappings advised as transparent
huge pages (MADV_HUGEPAGE), the tensors laid end to end. A 1-row pass streams every weight once,
and with 4 KiB pages each 4 KiB costs a page walk, which under a VM's nested paging is a long one;
2 MiB pages make a 1-row pass faster and change no bit, only where the bytes sit
(docs/benchmarks/huge-pages-lean-forward/). `SPECDEC_HUGE_PAGES=0` keeps ordinary pages (the ablation);
where the kernel has transparent huge pages off (`never`), the advice changes nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import threading
import warnings

import torch

from specdec import envs
from specdec import native_build

log = logging.getLogger(__name__)


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
    with two additions: torch.round costs a sizeable part of a few-row pass."""
    amax = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
    torch.mul(rows, levels / amax, out=out)
    out.add_(_ROUND).sub_(_ROUND)
    return amax.div_(levels)


def _native_wanted() -> bool:
    """Not turned off (SPECDEC_NATIVE_KERNELS=0: the fbgemm path)."""
    return envs.on("SPECDEC_NATIVE_KERNELS")


@functools.cache
def native_library() -> ctypes._CFuncPtr | None:
    """The native int8-rows kernel (specdec/csrc/int8_rows.c), loaded from beside its source where
    the install built it there (setup.py; an image: `python -m specdec.native_build`), else
    compiled on first use into `<cache root>/kernels/`; None where it cannot run here (no AVX2, not
    Linux x86-64, no C compiler) or fails to build (logged, and every Int8RowLinear then uses
    fbgemm: the worker's ModelInfo.kernels says "fbgemm"). torch is
    imported first, so the library's libgomp.so.1 is the one torch loaded: its parallel regions
    run on torch's threads."""
    if not (native_build.can_run_here() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        return None
    from specdec.model_store import cache_root

    shipped = native_build.SOURCE_DIR / native_build.library_name()
    path = shipped if shipped.exists() else native_build.build(cache_root() / "kernels")
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
    fn.isa = fn.set_isa("avx2" if envs.get("SPECDEC_NATIVE_ISA").lower() == "avx2" else "best")
    q4k = lib.specdec_q4k_rows_linear
    q4k.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
    q4k.restype = ctypes.c_int
    fn.q4k = q4k  # the library's second kernel (Q4KRowLinear)
    q6k = lib.specdec_q6k_rows_linear
    q6k.argtypes, q6k.restype = q4k.argtypes, ctypes.c_int
    fn.q6k = q6k  # and its third (Q6KRowLinear)
    decoder = lib.specdec_decoder_pass
    decoder.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                        ctypes.c_float, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    decoder.restype = ctypes.c_int
    fn.decoder = decoder  # the decoder layers around them (worker/forward.py's native_forward)
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
    return _aligned(padded.view(np_ // _TILE, _TILE, kp // _COLUMNS, _COLUMNS).transpose(1, 2))


def _native_rows(x: torch.Tensor, in_features: int, out_features: int, call) -> torch.Tensor:
    """x [..., in_features] through a native row kernel: call(rows_ptr, n, y_ptr) fills y
    [n, out_features] from the float32 rows and returns 0 (else: no scratch memory)."""
    shape = x.shape
    if x.dtype == torch.float32 and x.is_contiguous():  # a pass's activations: no copy
        rows = x.view(-1, in_features)
    else:
        rows = x.reshape(-1, in_features).to(torch.float32).contiguous()
    n = rows.shape[0]
    y = torch.empty(n, out_features)
    if n and call(rows.data_ptr(), n, y.data_ptr()) != 0:
        raise MemoryError("no scratch memory for the quantized rows")
    return y.view(*shape[:-1], out_features)


_bindings = 0  # how many times torch moved a native module's tensors (their addresses changed)


def bind_generation() -> int:
    """Changes whenever a native module rebinds its tensors' addresses (worker/forward.py's native
    forward keeps a table of them)."""
    return _bindings


class _NativeRows(torch.nn.Module):
    """What the native kernels' modules share: their tensors' addresses, taken once (`_bind`, again
    whenever torch moves or converts the module's tensors) rather than on every call: a decoding
    step makes ~200 calls, and reading 4 addresses through nn.Module's attribute lookup is a sizeable
    part of the Python around each (docs/benchmarks/huge-pages-lean-forward/)."""

    owns_memory = True  # its tensors are made here (modeling.own_memory leaves them)
    _ptrs: tuple = ()

    def _bind(self) -> None:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._bind()
        global _bindings
        _bindings += 1
        return module


class Int8RowLinear(_NativeRows):
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
            self._bind()
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

    def _bind(self) -> None:
        if self._native is not None:
            self._ptrs = (self._weight.data_ptr(), self._wsum.data_ptr(), self._scale.data_ptr(),
                          None if self.bias is None else self.bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None:
            weight, wsum, scale, bias = self._ptrs
            return _native_rows(x, self.in_features, self.out_features, lambda rows, m, y: self._native(
                rows, m, self.in_features, weight, self._columns, self.out_features, wsum, scale, bias, y,
                torch.get_num_threads()))
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
    CPU. It does with AVX-512 (a 9-row pass equals 9 steps); with AVX2 only a 2-row product
    differs from its rows alone in the last bits (docs/benchmarks/native-int8/), so
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


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def _huge_pages_wanted() -> bool:
    return envs.on("SPECDEC_HUGE_PAGES") and hasattr(mmap, "MADV_HUGEPAGE")


class WeightMemory:
    """Where the native kernels' weights live: chunks of anonymous memory advised as transparent
    huge pages, each tensor at the next 64-byte boundary of the current chunk (a chunk lives as
    long as a tensor in it does). Only the pages written become resident, so a chunk's unused end
    costs address space, not memory. Without huge pages (`SPECDEC_HUGE_PAGES=0`, or no
    MADV_HUGEPAGE on this platform) each tensor is an ordinary torch allocation."""

    CHUNK = 256 << 20

    def __init__(self):
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None  # uint8, HUGE_PAGE-aligned
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes], uninitialised, starting on a 64-byte boundary."""
        if not _huge_pages_wanted():
            flat = torch.empty(nbytes + 64, dtype=torch.uint8)
            start = (-flat.data_ptr()) % 64
            return flat[start:start + nbytes]
        with self._lock:
            if self._chunk is None or self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = self._map(max(self.CHUNK, nbytes)), 0
            out = self._chunk[self._used:self._used + nbytes]
            self._used += -(-nbytes // 64) * 64
            return out

    @staticmethod
    def _map(size: int) -> torch.Tensor:
        size = -(-size // HUGE_PAGE) * HUGE_PAGE
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while a tensor uses it
        start = (-flat.data_ptr()) % HUGE_PAGE
        region.madvise(mmap.MADV_HUGEPAGE, start, size)
        return flat[start:start + size]


weight_memory = WeightMemory()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A flat copy of `t` in weight_memory: 64-byte aligned, on huge pages where it can be."""
    return weight_memory.take(t.numel() * t.element_size()).view(t.dtype).copy_(t.reshape(-1))


Q4K_BLOCK, Q4K_COLUMNS = 144, 256  # ggml's block_q4_K: bytes, and the columns one covers


def q4k_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml Q4_K blocks, uint8 [N, K / 256 * 144] (a GGUF tensor's rows), as (d, dmin: float32
    [N, nb]; sc, mn: uint8 [N, nb, 8]; qs: uint8 [N, nb, 128]): w = d sc_j u - dmin mn_j per
    sub-block j of 32 columns (gguf-py's Q4_K.get_scale_min, in torch)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q4K_BLOCK)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    dmin = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    s = b[..., 4:16].reshape(n, -1, 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([lo & 63, (mix & 15) | ((lo >> 2) & 48)], dim=-1)
    mn = torch.cat([hi & 63, (mix >> 4) | ((hi >> 2) & 48)], dim=-1)
    return d, dmin, sc, mn, b[..., 16:]


def _q4k_values(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K nibbles [N, nb, 128] -> their 4-bit values [N, nb, 8 sub-blocks, 32 columns]
    (32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high ones)."""
    n, nb, _ = qs.shape
    chunks = qs.reshape(n, nb, 4, 32)
    return torch.stack([chunks & 15, chunks >> 4], dim=3).reshape(n, nb, 8, 32)


def q4k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that Q4_K blocks hold (gguf-py's Q4_K.dequantize_blocks)."""
    d, dmin, sc, mn, qs = q4k_unpack(blocks)
    n, nb = d.shape
    u = _q4k_values(qs)
    w = (d[..., None] * sc.float())[..., None] * u.float() - (dmin[..., None] * mn.float())[..., None]
    return w.reshape(n, nb * Q4K_COLUMNS)


def q4k_steps(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K nibbles [N, nb, 128] (the GGUF's order) in the native kernel's step order: [N, nb, 128]
    as [4][32], byte 4i + j of vector v holding column 4t + j of sub-block i for t = 2v (low
    nibble) and 2v + 1 (high nibble), so that lane i of a step is sub-block i's
    (specdec_q4k_rows_linear)."""
    n, nb, _ = qs.shape
    u = _q4k_values(qs).reshape(n, nb, 8, 8, 4)  # [sub-block i][step t][j]
    steps = u.transpose(2, 3).reshape(n, nb, 4, 2, 32)  # [step t = 2v + h][i, j]
    return (steps[:, :, :, 0] | (steps[:, :, :, 1] << 4)).reshape(n, nb, 128)


def _affine_4bit(x: torch.Tensor, steps: int = 4, spread: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub-blocks x [S, 32] -> (scale, offset) [S] each, w ~ scale * u - offset with u in 0..15:
    llama.cpp's make_qkx2_quants (ggml-quants.c) in torch: error weights rms(x) + |x|, the
    min/max grid, then steps + 1 other grids 15 + spread * (i - steps / 2) wide, each refit by
    weighted least squares; the best kept (the offset never negative: the min is at most 0)."""
    w = x.square().mean(dim=1, keepdim=True).sqrt() + x.abs()
    lo, hi = x.amin(dim=1).clamp(max=0), x.amax(dim=1)
    flat = hi - lo <= 0
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    grid = lambda levels: (levels[:, None] / span[:, None] * (x - lo[:, None])).round().clamp(0, 15)  # noqa: E731
    error = lambda scale, mn, u: (w * (scale[:, None] * u + mn[:, None] - x).square()).sum(dim=1)  # noqa: E731
    best_scale, best_min = span / 15, lo
    best = error(best_scale, best_min, grid(torch.full_like(span, 15.0)))
    sw, sx = w.sum(dim=1), (w * x).sum(dim=1)
    for i in range(steps + 1):
        u = grid(torch.full_like(span, 15.0 + spread * (i - steps / 2)))
        sl, sl2, sxl = (w * u).sum(dim=1), (w * u * u).sum(dim=1), (w * u * x).sum(dim=1)
        det = sw * sl2 - sl * sl
        fits = det > 0
        det = torch.where(fits, det, torch.ones_like(det))
        scale, mn = (sw * sxl - sx * sl) / det, (sl2 * sx - sl * sxl) / det
        positive = mn > 0  # a fit above zero: through zero instead
        scale = torch.where(positive, sxl / sl2.clamp(min=1e-30), scale)
        mn = torch.where(positive, torch.zeros_like(mn), mn)
        e = error(scale, mn, u)
        better = fits & (e < best)
        best, best_scale, best_min = (torch.where(better, e, best), torch.where(better, scale, best_scale),
                                      torch.where(better, mn, best_min))
    zero = torch.zeros_like(best_scale)
    return torch.where(flat, zero, best_scale), torch.where(flat, zero, -best_min)


def q4k_quantize(weight: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """A float weight [N, K] as ggml Q4_K blocks, uint8 [N, ceil(K / 256) * 144] (columns past K
    zero), the way llama.cpp's quantize_row_q4_K_ref makes them: per 32 columns an affine 4-bit
    grid (_affine_4bit), its scale and offset as 6-bit multiples of the super-block's float16 d
    and dmin, then each weight's nearest level under those. q4k_dequantize reads them back."""
    n, k = weight.shape
    kp = -(-k // Q4K_COLUMNS) * Q4K_COLUMNS
    nb = kp // Q4K_COLUMNS
    out = torch.empty(n, nb * Q4K_BLOCK, dtype=torch.uint8)
    for r in range(0, n, chunk):  # a chunk of rows at a time: the search's temporaries stay small
        x = torch.nn.functional.pad(weight[r:r + chunk].to(torch.float32), (0, kp - k)).reshape(-1, nb, 8, 32)
        m = x.shape[0]
        scale, offset = (t.reshape(m, nb, 8) for t in _affine_4bit(x.reshape(-1, 32)))
        top_scale, top_offset = scale.amax(dim=2), offset.amax(dim=2)
        d, dmin = (top_scale / 63).half().float(), (top_offset / 63).half().float()
        sc = (scale * torch.where(top_scale > 0, 63 / top_scale, 0.0)[..., None]).round().clamp(0, 63)
        mn = (offset * torch.where(top_offset > 0, 63 / top_offset, 0.0)[..., None]).round().clamp(0, 63)
        step, shift = d[..., None] * sc, dmin[..., None] * mn
        u = ((x + shift[..., None]) / step.clamp(min=1e-30)[..., None]).round().clamp(0, 15)
        u = torch.where(step[..., None] > 0, u, 0.0).to(torch.uint8)
        sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
        scales = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                            (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], dim=-1)  # q4k_unpack's inverse
        halves = torch.stack([d, dmin], dim=-1).half().view(torch.uint8).reshape(m, nb, 4)
        qs = (u[:, :, 0::2] | u[:, :, 1::2] << 4).reshape(m, nb, 128)
        out[r:r + chunk] = torch.cat([halves, scales, qs], dim=-1).reshape(m, nb * Q4K_BLOCK)
    return out


_Q4K_TILE = 8  # int8_rows.c's QTILE


def _q4k_tiles(per_block: torch.Tensor) -> torch.Tensor:
    """[N, nb, bytes] -> [N / 8, nb, 8, bytes] (N zero-padded to a multiple of 8): each tile of 8
    channels one sequential stream, super-block by super-block."""
    n, nb, width = per_block.shape
    np_ = -(-n // _Q4K_TILE) * _Q4K_TILE
    padded = torch.nn.functional.pad(per_block, (0, 0, 0, 0, 0, np_ - n))
    return padded.view(np_ // _Q4K_TILE, _Q4K_TILE, nb, width).transpose(1, 2).contiguous()


class _GGUFBlockRows(_NativeRows):
    """A Linear on a GGUF tensor's own blocks (int4-rows): the blocks repacked at load into the
    native kernel's tiles (`_qs`, `_meta`), int8 activations per row. Subclasses name the format:
    FORMAT (its ggml name), BLOCK (bytes per 256 columns), KERNEL (native_library()'s attribute),
    and pack(blocks) -> (per-block weight bytes, per-block meta bytes), each [N, K / 256, width]."""

    FORMAT, BLOCK, KERNEL = "", 0, ""

    def __init__(self, in_features: int, out_features: int, blocks: torch.Tensor, bias: torch.Tensor | None = None):
        """blocks: uint8 [out_features, in_features / 256 * BLOCK], the GGUF tensor's rows."""
        super().__init__()
        lib = native_library()
        if lib is None:
            raise RuntimeError("int4-rows needs the native kernel (Linux x86-64 with AVX2 and a C compiler)")
        padded = -(-in_features // Q4K_COLUMNS) * Q4K_COLUMNS  # columns the blocks cover (zero past in_features)
        if tuple(blocks.shape) != (out_features, padded // Q4K_COLUMNS * self.BLOCK):
            raise ValueError(f"{self.FORMAT} blocks of shape {tuple(blocks.shape)} do not hold a "
                             f"{out_features}x{in_features} weight")
        self._kernel = getattr(lib, self.KERNEL)
        self.in_features, self.out_features, self.padded_features = in_features, out_features, padded
        self.bias = None if bias is None else torch.nn.Parameter(
            bias.detach().to(torch.float32, copy=True), requires_grad=False)
        weights, meta = self.pack(torch.as_tensor(blocks, dtype=torch.uint8))
        self.register_buffer("_qs", _aligned(_q4k_tiles(weights)), persistent=False)
        self.register_buffer("_meta", _aligned(_q4k_tiles(meta)), persistent=False)
        self._bind()

    @staticmethod
    def pack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _bind(self) -> None:
        self._ptrs = (self._qs.data_ptr(), self._meta.data_ptr(), None if self.bias is None else self.bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qs, meta, bias = self._ptrs
        return _native_rows(x, self.in_features, self.out_features, lambda rows, m, y: self._kernel(
            rows, m, self.in_features, self.padded_features, qs, meta, self.out_features, bias, y,
            torch.get_num_threads()))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, the GGUF's {self.FORMAT} blocks"


class Q4KRowLinear(_GGUFBlockRows):
    """`--quantize int4-rows`, for a weight the source GGUF holds in Q4_K blocks: those very blocks
    (4.5 bits a weight, the numbers llama.cpp computes with; 4.625 bits here, the 6-bit scales
    stored as bytes), int8 activations per row, integer sums per 256-column super-block and one
    fixed float order per row: rows bitwise independent, as int8-rows. Native kernel only
    (specdec_q4k_rows_linear in specdec/csrc/int8_rows.c)."""

    FORMAT, BLOCK, KERNEL = "Q4_K", Q4K_BLOCK, "q4k"

    @staticmethod
    def pack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, dmin, sc, mn, qs = q4k_unpack(blocks)
        halves = torch.stack([d, dmin], dim=-1).half().view(torch.uint8)  # exact: they were float16
        return q4k_steps(qs), torch.cat([sc, mn, halves.reshape(*d.shape, 4)], dim=-1)


Q6K_BLOCK = 210  # ggml's block_q6_K: ql[128], qh[64], scales[16] (signed), d (float16); 256 columns


def q6k_unpack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml Q6_K blocks, uint8 [N, K / 256 * 210] (a GGUF tensor's rows), as (d: float32 [N, nb];
    sc: int8 [N, nb, 16]; u: uint8 [N, nb, 256], each column's 6-bit value): w = d sc_j (u - 32)
    for sub-block j of 16 columns (gguf-py's Q6_K.dequantize_blocks, in torch)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, Q6K_BLOCK)
    nb = b.shape[1]
    ql, qh = b[..., :128].reshape(n, nb, 2, 1, 64), b[..., 128:192].reshape(n, nb, 2, 1, 32)
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 15  # [n, nb, 2 halves, 2, 64]
    top = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [n, nb, 2 halves, 4, 32]
    u = low.reshape(n, nb, 256) | (top.reshape(n, nb, 256) << 4)
    sc = b[..., 192:208].contiguous().view(torch.int8)
    d = b[..., 208:210].contiguous().view(torch.float16).squeeze(-1).float()
    return d, sc, u


def q6k_dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The float32 weights [N, K] that Q6_K blocks hold (gguf-py's Q6_K.dequantize_blocks)."""
    d, sc, u = q6k_unpack(blocks)
    n, nb = d.shape
    w = (d[..., None] * sc.float())[..., None] * (u.view(n, nb, 16, 16).float() - 32)
    return w.reshape(n, nb * Q4K_COLUMNS)


def q6k_packed(u: torch.Tensor) -> torch.Tensor:
    """6-bit values [N, nb, 256] in the native kernel's order (int8_rows.c, Q6_K): [N, nb, 192],
    four vectors of 32 bytes (vector t: step t of the first half in the low nibbles, of the second
    in the high ones; byte 4i + j of a step: column 16i + 4t + j of the half) and two of top bits
    (vector h: half h, step t in bits 2t and 2t + 1)."""
    n, nb, _ = u.shape
    steps = u.view(n, nb, 2, 8, 4, 4).transpose(3, 4).reshape(n, nb, 2, 4, 32)  # [half][step][32]
    nibbles = (steps[:, :, 0] & 15) | ((steps[:, :, 1] & 15) << 4)  # [n, nb, 4, 32]
    tops = steps >> 4
    top = tops[..., 0, :] | (tops[..., 1, :] << 2) | (tops[..., 2, :] << 4) | (tops[..., 3, :] << 6)  # [n, nb, 2, 32]
    return torch.cat([nibbles.reshape(n, nb, 128), top.reshape(n, nb, 64)], dim=-1)


class Q6KRowLinear(_GGUFBlockRows):
    """`--quantize int4-rows`, for a weight the source GGUF holds in Q6_K blocks (in the default
    target: the head and the Q6_K half of its attention values and MLP outputs): those very blocks,
    6.5625 bits a weight (6.625 here: scales and d padded to 20 bytes) where int8-rows read 8 and a
    fresh rounding, int8 activations per row, integer sums per 256-column super-block: rows bitwise
    independent, as Q4KRowLinear. Native kernel only (specdec_q6k_rows_linear in int8_rows.c)."""

    FORMAT, BLOCK, KERNEL = "Q6_K", Q6K_BLOCK, "q6k"

    @staticmethod
    def pack(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, sc, u = q6k_unpack(blocks)
        meta = torch.cat([sc.view(torch.uint8), d.half()[..., None].view(torch.uint8),
                          torch.zeros(*d.shape, 2, dtype=torch.uint8)], dim=-1)  # [N, nb, 20]
        return q6k_packed(u), meta


KERNELS = {"int8-rows": Int8RowLinear, "int8": Int8Linear, "fp16": Fp16Linear}


def replace_linears(model: torch.nn.Module, quantization: str, blocks: dict | None = None) -> torch.nn.Module:
    """Replaces every CPU nn.Linear of the model by the module of `quantization` (a KERNELS key,
    or int4-rows), in place, calling the kernels directly (torch.ao.quantization's module
    swapping is deprecated and warns). int4-rows: a Q4KRowLinear (Q6KRowLinear) for each Linear whose
    qualified name `blocks` maps to its Q4_K (Q6_K) blocks (modeling.gguf_blocks reads them from the
    source GGUF), int8-rows for every other one."""
    if quantization in ("int4-rows", "q4k-rows"):
        blocks = blocks or {}

        def kernel(child, name):
            rows = blocks.get(name)
            if rows is None and quantization == "q4k-rows":
                rows = q4k_quantize(child.weight.detach())
            if rows is None:
                return Int8RowLinear(child)
            q6k = rows.shape[1] == -(-child.in_features // Q4K_COLUMNS) * Q6K_BLOCK  # else Q4_K's 144 bytes a block
            return (Q6KRowLinear if q6k else Q4KRowLinear)(child.in_features, child.out_features, rows, child.bias)
    else:
        kernel = lambda child, name: KERNELS[quantization](child)  # noqa: E731
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and child.weight.device.type == "cpu":
                setattr(parent, name, kernel(child, f"{prefix}.{name}" if prefix else name))
    return model


