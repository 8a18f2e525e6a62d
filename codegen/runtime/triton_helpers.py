"""`@triton.jit` helpers that generated kernels call, and the plain-torch twins of those whose
values the torch path must reproduce.

Generated kernels call these as `helpers.exp(v)`, `helpers.below(cols, N, EVEN)`: Triton
compiles a helper into each kernel that calls it, so a helper costs nothing at run time.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

#: values recovered by dividing by a parameter (memory modes that keep the output) clamp the
#: parameter's magnitude below at this, so a zero weight gives finite gradients, never NaN
#: (the engine's `GuardedReciprocal.guard`)
INVERSION_GUARD = 1e-06
_INVERSION_GUARD = tl.constexpr(INVERSION_GUARD)
#: compiled kernels take the flush-to-zero exponential (the interpreter has no libdevice)
_FAST = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def column_block(chunk, CHUNKS: tl.constexpr, BACKWARDS: tl.constexpr):
    """The column block step `chunk` of a sweep over CHUNKS blocks reads: the chunk-th, or
    counted from the last one where the sweep runs BACKWARDS."""
    if BACKWARDS:
        block = CHUNKS - 1 - chunk
    else:
        block = chunk
    return block


@triton.jit
def below(index, bound, EVEN: tl.constexpr):
    """index < bound, or all true at compile time where the shape tiles exactly (EVEN)."""
    if EVEN:
        result = tl.full(index.shape, 1, tl.int1)
    else:
        result = index < bound
    return result


@triton.jit
def split_exchange(count_ptr, arrivals):
    """The split kernels' meeting point: this program's stores so far are released to its group
    (every thread's stores issued first), then it waits until the group's counter holds
    `arrivals` (each program adds one an exchange) and acquires what the others stored. Programs
    of a group must run at once: a cooperative launch, and one program under the interpreter,
    which runs programs one after another."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < arrivals:
        pass


@triton.jit
def column_sum(partial_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[c] = sum_p partial[p, c] over this program's BLOCK_C columns, in a fixed order."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    col_mask = cols < N
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=partial_ptr.dtype.element_ty)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)[:, None]
        acc += tl.load(
            partial_ptr + rows.to(tl.int64) * N + cols, mask=(rows < P) & col_mask, other=0.0
        )
    total = tl.sum(acc, axis=0)[None, :]
    if not _FAST and acc.dtype == tl.float64 and out_ptr.dtype.element_ty == tl.bfloat16:
        # the interpreter's float64 -> bfloat16 conversion takes the wrong bits (a bfloat16
        # parameter of a float64 input): through float32
        total = total.to(tl.float32)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def column_sums_kernel(
    p0, o0, p1, o1, p2, o2, P, N, COUNT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr
):
    """Up to three column sums in one launch: grid axis 1 picks the (partial, out) pair; the
    pairs past COUNT are None."""
    store = tl.program_id(1)
    if store == 0:
        column_sum(p0, o0, P, N, BLOCK_P, BLOCK_C)
    if COUNT > 1:
        if store == 1:
            column_sum(p1, o1, P, N, BLOCK_P, BLOCK_C)
    if COUNT > 2:
        if store == 2:
            column_sum(p2, o2, P, N, BLOCK_P, BLOCK_C)


@triton.jit
def sqrt(v):
    """sqrt(v), correctly rounded."""
    if v.dtype == tl.float64:
        return tl.sqrt(v)
    else:
        return tl.sqrt_rn(v)


@triton.jit
def rsqrt(v, FIXED_N: tl.constexpr):
    """1 / sqrt(v): correctly rounded (`sqrt`, then a division), or in a kernel compiled for its
    row width (FIXED_N) at fp32 the approximate reciprocal square root, one MUFU.RSQ, as torch's
    own CUDA norms and torch.compile's kernels take it (the interpreter's is exact)."""
    if FIXED_N and v.dtype == tl.float32:
        if _FAST:
            return libdevice.rsqrt(v)
        else:
            return tl.rsqrt(v)
    else:
        return 1.0 / sqrt(v)


@triton.jit
def exp(v, EXACT: tl.constexpr):
    """exp(v). Compiled fp32 takes, EXACT, libdevice's expf, within 2 ulps at every argument: it
    reduces the argument by a two-part ln 2 before MUFU.EX2; else ex2.approx.ftz (a multiply
    and MUFU.EX2, where tl.exp adds three instructions to keep results below 2^-126 from
    flushing to 0), which rounds v · log2 e first and errs |v| · 2^-24 relative: 1e-6 at
    v = -20, six ulps of an fp32 softmax's small entries (torch's expf errs below one), and
    well below a 16-bit result's rounding. The exact form costs a cross-entropy 20-30% of its
    time at 4096 x 32000 on an H100, so kernels of 16-bit elements keep the fast one."""
    if _FAST and v.dtype == tl.float32:
        if EXACT:
            return libdevice.exp(v)
        else:
            return libdevice.fast_expf(v)
    else:
        return tl.exp(v)


@triton.jit
def div(a, b, EXACT: tl.constexpr):
    """a / b. Compiled fp32 takes, EXACT, the correctly rounded quotient, as torch's CUDA ops
    divide; else Triton's `/` (div.full.f32: within 2 ulps, a few instructions fewer), whose
    error a 16-bit result's rounding hides. An fp32 softmax's p = e / sum two ulps off shows
    in its backward, p · (dp - Σ dp·p), where p ≈ 1 cancels."""
    q = a / b
    if _FAST and EXACT:
        if q.dtype == tl.float32:
            # either side may be a number or an integer (a mean's width): at the quotient's type
            return tl.math.div_rn(tl.cast(a, tl.float32), tl.cast(b, tl.float32))
        else:
            return q
    else:
        return q


@triton.jit
def tanh(v):
    """tanh(v) = sign(v) · (1 - e) / (1 + e), e = exp(-2|v|) <= 1: saturates to ±1 for large |v|,
    never NaN, and within a few ulps everywhere. For |v| > 0.55 (e < 1/3) as 1 - 2e / (1 + e),
    one rounding off the exact quotient, so 1 + tanh(v) keeps its digits far left (gelu's tail);
    below, 1 - e is -expm1(-2|v|), by Kahan's (e - 1) · w / log(e), whose quotient cancels e's
    rounding, so small |v| keep theirs (tanh(1e-3) to a few ulps, where 2 / (1 + exp(-2v)) - 1
    keeps four digits, and tanh(1e-13) is not 0)."""
    w = -2.0 * tl.abs(v)
    # e <= 1 scales the result's own rounding: the fast exponential's error does not show
    e = exp(w, False)
    expm1 = tl.where(e == 1.0, w, (e - 1.0) * (w / tl.log(e)))
    magnitude = tl.where(e > 1.0 / 3.0, -expm1 / (2.0 + expm1), 1.0 - 2.0 * e / (1.0 + e))
    return tl.where(v < 0.0, -magnitude, magnitude)


@triton.jit
def log1p(v):
    """log(1 + v), accurate where 1 + v rounds v's digits away: log(u) · v / (u - 1) with u the
    rounded 1 + v, whose rounding error the quotient cancels (Goldberg, 1991); v itself where u
    rounds to 1, inf at v = inf."""
    u = 1.0 + v
    exact = tl.log(u) * (v / (u - 1.0))
    return tl.where(u == 1.0, v, tl.where(u == float("inf"), u, exact))


@triton.jit
def stable_shift(peak):
    """The shift of a stabilising row max: the max itself where finite or +inf, 0 where it is
    -inf (a row of -inf, or fully masked); a NaN max stays NaN. A row holding +inf is shifted by
    the +inf, as torch.softmax and torch.nn.functional.cross_entropy shift it: exp(x - inf) is 0
    at every finite x and exp(inf - inf) NaN at the +inf, so the row's sum, and every value and
    gradient read from it, is NaN, as torch's softmax and cross-entropy are throughout such a
    row (one rule for every op stabilised by a row max; torch.logsumexp alone returns +inf
    there, where a log-sum-exp op gives NaN). A row of -inf is shifted by 0, never by
    -inf (exp(-inf + inf) = NaN): every exp(x - 0) is 0, the sum 0, and softmax's 0 / 0 is
    torch's NaN (a fully masked softmax row reads the sum through a guarded reciprocal: 0)."""
    return tl.where(peak == float("-inf"), 0.0, peak)


def stable_shift_torch(peak):
    """`stable_shift` in plain torch: +inf and NaN stay, -inf becomes 0, finite values stay."""
    return torch.where(peak == -math.inf, 0.0, peak)


@triton.jit
def guarded_reciprocal(v):
    """1 / v with |v| clamped below at INVERSION_GUARD (Apex's clamp_by_magnitude); NaN stays NaN
    (tl.maximum would drop it)."""
    magnitude = tl.maximum(tl.abs(v), _INVERSION_GUARD)
    return tl.where(v == v, tl.where(v < 0.0, -1.0 / magnitude, 1.0 / magnitude), v)


def guarded_reciprocal_torch(v):
    """`guarded_reciprocal` in plain torch."""
    v = torch.as_tensor(v)
    magnitude = v.abs().clamp_min(INVERSION_GUARD)
    return torch.where(v < 0.0, -1.0 / magnitude, 1.0 / magnitude)


@triton.jit
def uniform(seed, rows, col0, N, BLOCK_N: tl.constexpr):
    """U[0, 1) for each element (row, col) of the tile of rows x BLOCK_N columns from col0: word
    col % 4 of Philox4x32-10 of the counter (c low word, c high word, 0, 0), c = row * ceil(N / 4)
    + col // 4, under the key (seed low word, seed high word), mapped to a float as tl.rand does.
    A Philox call gives four words: a tile of BLOCK_N >= 4 columns (col0 a multiple of 4) draws
    one per four columns and interleaves them, a quarter of the integer multiplies a word per
    element would take. Nothing is stored: a backward regenerates the same values. Rows
    compiled for their width (FIXED_N) come as 32-bit offsets of fewer than 2^31 elements:
    their counter fits in the low word and the high word is 0."""
    if BLOCK_N >= 4:
        counter = rows * ((N + 3) // 4) + (col0 // 4 + tl.arange(0, BLOCK_N // 4))[None, :]
    else:
        cols = col0 + tl.arange(0, BLOCK_N)[None, :]
        counter = rows * ((N + 3) // 4) + cols // 4
    if counter.dtype == tl.int32:
        low = counter.to(tl.uint32)
        high = low * 0
    else:
        low = (counter & 0xFFFFFFFF).to(tl.uint32)
        high = (counter >> 32).to(tl.uint32)
    zero = low * 0
    w0, w1, w2, w3 = tl.philox(seed, low, high, zero, zero)
    if BLOCK_N >= 4:
        bits = tl.interleave(tl.interleave(w0, w2), tl.interleave(w1, w3))
    else:
        word = cols % 4
        bits = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return tl.uint_to_uniform_float(bits)


_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_WORD = 0xFFFFFFFF


def _multiply_words(a, b):
    """(a * b) >> 32 and (a * b) & 0xFFFFFFFF for 32-bit words a (int64 tensor) and b, in
    16-bit halves so every product fits in int64."""
    low, high = a & 0xFFFF, a >> 16
    low_product, high_product = low * b, high * b
    return (
        (high_product + (low_product >> 16)) >> 16,
        (low_product + ((high_product & 0xFFFF) << 16)) & _WORD,
    )


def partner_torch(x, pairing):
    """x (rows of a width N, the last dim) at each column's partner of `pairing`: "half" swaps
    the halves (column j reads (j + N/2) mod N), "interleaved" each pair (j reads j xor 1). A
    number (an absent input's value) is the same at every column."""
    if not isinstance(x, torch.Tensor):
        return x
    if pairing == "half":
        return x.roll(x.shape[-1] // 2, dims=-1)
    return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def uniform_torch(seed, M, N, first_row=0):
    """`uniform` in plain torch, bit for bit: the same values on the torch path, for rows
    first_row .. first_row + M - 1 of a width-N tensor. A seed given as a 0-d int64 tensor is
    read on its device, never copied to the host: a backward that autograd records, or that
    torch.compile traces, draws the forward's values without a sync."""
    device = seed.device if isinstance(seed, torch.Tensor) else "cpu"
    quads = -(-N // 4)
    c0 = torch.arange(first_row * quads, (first_row + M) * quads, dtype=torch.int64, device=device)
    c0, c1 = c0 & _WORD, c0 >> 32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = seed & _WORD, (seed >> 32) & _WORD
    for _ in range(10):
        high_b, low_b = _multiply_words(c2, _PHILOX_ROUND_B)
        high_a, low_a = _multiply_words(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _WORD, (k1 + _PHILOX_KEY_B) & _WORD
    words = torch.stack((c0, c1, c2, c3), dim=1).reshape(M, quads * 4)[:, :N]
    signed = torch.where(words >= 2**31, words - 2**32, words)  # each word as an int32
    magnitude = torch.where(signed < 0, -signed - 1, signed).to(torch.int32)
    return magnitude.to(torch.float32) * torch.tensor(4.6566127342e-10)
