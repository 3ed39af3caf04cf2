# SPDX-License-Identifier: Apache-2.0
"""How tmsdisk.optim keeps Adam's moments in a bucket: as they are (fp32, bf16), or block-scaled.

A block-scaled moment is a narrow float (fp8) per element and one fp32 scale per MOMENT_BLOCK elements:
each block is divided by its largest magnitude over the narrow dtype's largest finite value, so that
every block uses the dtype's whole range whatever its own magnitude. The code is generic over the narrow
dtype (any floating dtype torch.finfo knows): the tests drive it with float16 where torch has no fp8.

exp_avg_sq is kept as its square root. It is non-negative and the square of a gradient's scale, so it
spans twice the decades exp_avg does; its root spans exp_avg's own, and what the update divides by is
that root: an element rounded by r relative changes the step by r, not by r/2 as through a square.
Both moments are therefore float8_e4m3fn (3 mantissa bits, 2^17.8 between the smallest subnormal and
448): within a block of 128, after the root, the range of gradient scales fits, and e4m3 rounds the
divisor to within 6.25%. float8_e5m2 would buy range the scale and the root already give (2^31) at
the price of one of those bits (12.5%).

A step's update rounds with stochastic rounding: to the neighbour above with a probability of the
distance from the one below, so that a moment moves on average by what the update added. Rounding to
nearest loses every change smaller than half a step of the grid: with beta2 = 0.999 a step adds 0.1% to
exp_avg_sq, far below e4m3's 6% steps, and the stored moment would stop following the gradients (then
shrink under the bias correction's growing denominator, and the steps grow). The noise drawn comes from
a generator seeded from the step count and the bucket (MomentFormat.seed), so a run, and a run resumed
from a checkpoint, rounds the same. Loading a state dict rounds to nearest: it is no EMA step.

A non-zero exp_avg_sq is never stored as zero: its root is kept at least at the smallest subnormal of
its block. A zero there would divide a non-zero exp_avg by eps alone (1e-8), a step of the learning
rate times 10^8 for that element; the floor rounds such tiny divisors up, which makes those steps
smaller, never larger.
"""

import math
from collections import namedtuple

import torch

MOMENT_BLOCK = 128  # elements per fp32 scale: 4 bytes per 128 is 3% over the fp8 bytes

# Blocks quantized at once: bounds the fp32 temporaries of an update at a few of 64 MiB each, whatever
# the bucket's size (a bucket of 200 M elements would otherwise hold several 800 MB ones).
_PIECE_BLOCKS = (16 << 20) // MOMENT_BLOCK

# A bucket's sections as tensors: the fp32 masters, the two moments as stored, and for block-scaled
# moments their scales (None otherwise).
Sections = namedtuple("Sections", "master exp_avg exp_avg_sq exp_avg_scales exp_avg_sq_scales")


def _element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PlainMoments:
    """Moments stored as a dtype of their own (fp32, or bf16 updated in fp32): no scales."""

    block = None

    def __init__(self, dtype):
        self.dtype = dtype
        self.element_size = _element_size(dtype)
        self.state_dtype = dtype  # of the moments in a state_dict: the stored ones, exactly

    def describe(self) -> dict:
        return {}

    def stored(self, sections):
        """The moments as a state_dict holds them (the stored tensors themselves)."""
        return sections.exp_avg, sections.exp_avg_sq

    def working(self, sections):
        """fp32 tensors that the update changes: the stored ones when fp32 (in place), else copies."""
        if self.dtype == torch.float32:
            return sections.exp_avg, sections.exp_avg_sq
        return sections.exp_avg.float(), sections.exp_avg_sq.float()

    def blank(self, sections):
        """Tensors to fill a bucket's moments into (the section is zeroed by the caller)."""
        return sections.exp_avg, sections.exp_avg_sq

    def store(self, sections, exp_avg, exp_avg_sq, generator=None) -> None:  # pylint: disable=unused-argument
        """Puts working tensors back (a copy rounds fp32 to bf16 to nearest; the same tensors: nothing)."""
        if exp_avg is not sections.exp_avg:
            sections.exp_avg.copy_(exp_avg)
        if exp_avg_sq is not sections.exp_avg_sq:
            sections.exp_avg_sq.copy_(exp_avg_sq)

    def seed(self, bucket_index, step) -> None:  # pylint: disable=unused-argument
        return None  # nothing to draw


class BlockScaledMoments:
    """Moments stored as `dtype` in blocks of `block` elements with an fp32 scale each; exp_avg_sq as
    its square root (the module says why)."""

    def __init__(self, dtype, block=MOMENT_BLOCK):
        info = torch.finfo(dtype)
        self.dtype = dtype
        self.block = block
        self.element_size = _element_size(dtype)
        self.state_dtype = torch.float32  # a state_dict holds the values, scaled back, in fp32
        self.max = float(info.max)
        # The grid: 2^e for the binade e has 2^mantissa_bits steps, e no lower than the smallest normal's
        # (below it, subnormals keep that step).
        self.mantissa_bits = round(-math.log2(info.eps))
        self.min_exponent = round(math.log2(info.tiny))
        self.smallest = 2.0 ** (self.min_exponent - self.mantissa_bits)

    def describe(self) -> dict:
        """What a checkpoint's manifest records beside the dtype: another block size is another layout."""
        return {"moment_block": self.block, "exp_avg_sq_stored_as": "sqrt"}

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    # -- the codec ---------------------------------------------------------------------------------

    def dequantize(self, q, scales, out, square=False) -> None:
        """out (fp32, q's length) = q * its block's scale (squared when `square`)."""
        n, b = q.numel(), self.block
        full = n // b
        if full:
            rows = out[: full * b].view(full, b)
            rows.copy_(q[: full * b].view(full, b))
            rows.mul_(scales[:full].view(full, 1))
        if n % b:
            out[full * b : n].copy_(q[full * b :])
            out[full * b : n].mul_(scales[full])
        if square:
            out.mul_(out)

    def quantize(self, x, q, scales, generator=None, root=False) -> None:
        """q and scales from x (fp32, contiguous): per block, scale = absmax / max, q = x / scale rounded to
        nearest, or stochastically with `generator`; with `root`, of sqrt(x), never rounded to zero where x
        is positive. An all-zero block keeps scale 1."""
        n, b = x.numel(), self.block
        step = b * _PIECE_BLOCKS
        for at in range(0, n, step):
            piece = x[at : at + step]
            m = piece.numel()
            nb = self.blocks(m)
            if m % b:
                piece = torch.cat([piece, piece.new_zeros(nb * b - m)])
            y, scale = self._encode(piece.view(nb, b), generator, root)
            q[at : at + m].copy_(y.view(-1)[:m])  # exact: y is on the dtype's grid
            scales[at // b : at // b + nb].copy_(scale.view(-1))

    def _encode(self, rows, generator, root):
        if root:
            rows = rows.sqrt()
        magnitude = rows.abs()
        absmax = magnitude.amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / self.max, torch.ones_like(absmax))
        y = rows / scale
        # The block's largest lands on the largest value exactly, not a rounding error below it (which
        # stochastic rounding could take a whole step down); a zero block's sign is 0.
        y = torch.where(magnitude == absmax, rows.sign() * self.max, y)
        y.clamp_(-self.max, self.max)
        if root:
            y = torch.where(rows > 0, y.clamp(min=self.smallest), y)
        if generator is not None:
            y = self._round_stochastic(y, generator)
        return y, scale

    def _round_stochastic(self, y, generator):
        """y (fp32, within +-max) onto the dtype's grid: up with probability (y - below) / step.

        The step at y is built from y's fp32 exponent bits: 2^(e - mantissa_bits), e no lower than the
        smallest normal's. Every operation is exact (powers of two, floor), so the result is on the grid
        and the narrowing copy after it does not round again."""
        exponent = ((y.view(torch.int32) >> 23) & 0xFF) - 127
        exponent.clamp_(min=self.min_exponent)
        ulp = ((exponent + (127 - self.mantissa_bits)) << 23).view(torch.float32)
        t = y / ulp
        below = t.floor()
        draw = torch.rand(y.shape, generator=generator, device=y.device)
        return (below + (draw < t - below).to(torch.float32)) * ulp

    # -- the optimizer's uses ----------------------------------------------------------------------

    def stored(self, sections):
        return self.working(sections)

    def working(self, sections):
        n = sections.exp_avg.numel()
        exp_avg = torch.empty(n, dtype=torch.float32, device=sections.exp_avg.device)
        exp_avg_sq = torch.empty_like(exp_avg)
        self.dequantize(sections.exp_avg, sections.exp_avg_scales, exp_avg)
        self.dequantize(sections.exp_avg_sq, sections.exp_avg_sq_scales, exp_avg_sq, square=True)
        return exp_avg, exp_avg_sq

    def blank(self, sections):
        n = sections.exp_avg.numel()
        return (torch.zeros(n, dtype=torch.float32, device=sections.exp_avg.device),
                torch.zeros(n, dtype=torch.float32, device=sections.exp_avg.device))

    def store(self, sections, exp_avg, exp_avg_sq, generator=None) -> None:
        self.quantize(exp_avg, sections.exp_avg, sections.exp_avg_scales, generator)
        self.quantize(exp_avg_sq, sections.exp_avg_sq, sections.exp_avg_sq_scales, generator, root=True)

    def seed(self, bucket_index, step):
        """A generator's seed for the update of bucket `bucket_index` (its rank in the optimizer) to step
        count `step`: the same numbers drawn whenever that update is made again."""
        return (int(step) << 24) ^ bucket_index


# --- the dtypes accepted ------------------------------------------------------------------------------
# The moments' dtypes: kept as they are, or (fp8) in blocks of MOMENT_BLOCK with a scale each (the module's
# docstring says why e4m3 for both, exp_avg_sq as its root). Torch before 2.1 has no fp8: only the name is
# known.
_PLAIN_MOMENTS = (torch.float32, torch.bfloat16)
_FP8_NAME = "float8_e4m3fn"
_SCALED_MOMENTS = {}  # dtype -> its BlockScaledMoments; the tests add float16 to drive the codec
if hasattr(torch, _FP8_NAME):
    _SCALED_MOMENTS[getattr(torch, _FP8_NAME)] = BlockScaledMoments(getattr(torch, _FP8_NAME))
# moment_dtype= may be given by name too (what TMSDISK_STREAM_OPTIMIZER says).
_MOMENT_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp8": _FP8_NAME}


def _moments_of(cls, moment_dtype):
    """How `moment_dtype` (a torch.dtype, or a name: fp32, bf16, fp8, float8_e4m3fn, torch.bfloat16...)
    is kept; ValueError naming what is accepted, or that this torch lacks fp8."""
    if isinstance(moment_dtype, str):
        name = moment_dtype.strip()
        name = _MOMENT_NAMES.get(name.lower(), name[len("torch."):] if name.startswith("torch.") else name)
        found = getattr(torch, name, None)
        if not isinstance(found, torch.dtype):
            if name.startswith("float8"):
                raise ValueError("%s: moment_dtype %r: this torch (%s) has no torch.%s; fp8 moments need "
                                 "PyTorch 2.1 or later" % (cls, moment_dtype, torch.__version__, name))
            found = None
        moment_dtype = found if found is not None else moment_dtype
    if moment_dtype in _PLAIN_MOMENTS:
        return PlainMoments(moment_dtype)
    if moment_dtype in _SCALED_MOMENTS:
        return _SCALED_MOMENTS[moment_dtype]
    fp8 = "torch.%s" % _FP8_NAME if hasattr(torch, _FP8_NAME) else "(with PyTorch 2.1 or later) torch.%s" % _FP8_NAME
    raise ValueError("%s: moment_dtype must be torch.float32, torch.bfloat16 or %s, not %r" % (
        cls, fp8, moment_dtype))


def _moment_conversion(source, target):
    """How moments of dtype `source` become `target`: None when they may not (ValueError upstream).

    The same dtype is taken as is; widening to fp32 is exact; fp32 to bf16 rounds (what a bf16-moment
    optimizer would have kept had it run from the start). Block-scaled targets (fp8) take fp32, bf16
    and fp16 and round them to nearest in their blocks: their scales give them any range. Anything else
    would lose range or precision behind the caller's back.
    """
    if source == target:
        return "same"
    if target == torch.float32 and source in (torch.bfloat16, torch.float16):
        return "widened"
    if source == torch.float32 and target == torch.bfloat16:
        return "rounded"
    if target in _SCALED_MOMENTS and source in (torch.float32, torch.bfloat16, torch.float16):
        return "rounded"
    return None
