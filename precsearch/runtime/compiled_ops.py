"""The compiled step's opaque ops (precsearch.runtime.compiled): each runs outside Inductor's fusion, where fusing
would hold more memory than the eager runtime holds.

* ``round_site``: a site's rounding (and its codes) in one compiled pass, the format a row of data
  (precsearch.formats.as_data); ``round_scaled_site`` the same for a scaled format (precsearch.formats.scaled);
  ``count_overflows`` its overflow count alone, for a value that arrives rounded alike;
* ``conv_backward_of_codes`` and ``batch_norm_backward_of_codes``: a convolution's and a training batch norm's
  backward over its input's codes, decoded a slice at a time (precsearch.runtime.sliced), as the eager runtime
  decodes its packed codes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch

from precsearch.formats.as_data import decode_patterns, encode_codes, patterns_of, round_nearest, round_values
from precsearch.formats.format import ROUNDINGS
from precsearch.formats.runner import labelled, run_kernel
from precsearch.formats.scaled import ScaledFormat, e8m0_decode, expand_scales, get_scaled_format, scaled_values
from precsearch.runtime.packing import Stored, batch_passes
from precsearch.runtime.sliced import ConvGeometry, batch_norm_backward_in_slices, conv_backward_in_slices

__all__ = ["batch_norm_backward_of_codes", "conv_backward_of_codes", "count_overflows", "round_scaled_site",
           "round_site"]


def _decode_bytes(flat: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return decode_patterns(flat, row)


def _decode_byte_planes(flat: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    return decode_patterns(patterns_of(flat.view(2, -1), 2), row)


# one fused pass each, for any format (its row) and length, as the eager runtime's own decoders
_DECODERS = {1: labelled("decode codes", _decode_bytes), 2: labelled("decode byte planes", _decode_byte_planes)}


class _CodesInSlices:
    """A site's codes in a compiled step's backward, decoded a slice at a time by the sliced backwards
    (precsearch.runtime.sliced.Slices), as the eager runtime decodes its packed codes: each slice in one
    compiled pass (``_DECODERS``), not the dozen whole-slice temporaries of ``decode_codes`` run eagerly; a
    scaled site's values (``scaled``, by name) times their scales, e8m0 bytes (``scales``) as the eager runtime
    holds them (``ops.Codes.part``: a slice of rows takes its rows' scales, another slice of a row- or
    block-scaled tensor the whole tensor's)."""

    def __init__(self, codes: torch.Tensor, row: torch.Tensor, nbytes: int, scales: torch.Tensor | None,
                 scaled: str | None) -> None:
        self.codes, self.row, self.nbytes, self.scales = codes, row, nbytes, scales
        self.scaled = None if scaled is None else get_scaled_format(scaled)
        self.shape = codes.shape if nbytes == 1 else codes.shape[1:]  # 2 bytes: the byte planes stacked first

    def slicer(self, dim: int = 0) -> Callable[[int, int], torch.Tensor]:
        axis = dim + (self.nbytes != 1)

        def decode(start: int, length: int) -> torch.Tensor:
            part = self.codes.narrow(axis, start, length)
            values = run_kernel(_DECODERS[self.nbytes], part.reshape(-1), self.row).view(part.shape[axis - dim:])
            return values if self.scaled is None else values * self._scales(dim, start, length, values.shape)

        return decode

    def _scales(self, dim: int, start: int, length: int, shape: torch.Size) -> torch.Tensor:
        """The scales of a slice, expanded over its values."""
        fmt, scales = self.scaled, e8m0_decode(self.scales)
        if fmt.granularity == "tensor":
            return scales
        if dim == 0:
            return expand_scales(scales.narrow(0, start, length), fmt, shape)
        return expand_scales(scales, fmt, self.shape).narrow(dim, start, length)

    def batch_slices(self, rows: int) -> Callable[[], Iterator[tuple[int, torch.Tensor]]]:
        return batch_passes(self.slicer(), self.shape[0], rows)


def _coded(values: torch.Tensor, overflowed: torch.Tensor, row: torch.Tensor,
           nbytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounded ``values``, or (``nbytes``) their codes; and [values that overflowed, values the format has no code
    for] (int32)."""
    unencodable = torch.zeros_like(overflowed)
    if nbytes is not None:
        values, unencodable = encode_codes(values, row, nbytes)
    return values, torch.stack([overflowed.to(torch.int32), unencodable.to(torch.int32)])


def _what(nbytes: int | None) -> str:
    return "rounded" if nbytes is None else f"rounded to {nbytes}-byte codes"


def _site_kernel(rounding: str, nbytes: int | None):
    """One pass over a flat tensor: its values rounded by ``row`` (``rounding`` a constant), or their codes, and
    its counts (``_coded``)."""

    def round_site(flat: torch.Tensor, row: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # in floats: compiled.unsupported refuses nearest rounding to a format of no mantissa bit
        return _coded(*round_values(flat, row, seed, rounding, in_floats=True), row, nbytes)

    return labelled(f"site {_what(nbytes)} ({rounding})", round_site)


_SITE_KERNELS = {(rounding, nbytes): _site_kernel(rounding, nbytes)
                 for rounding in ROUNDINGS for nbytes in (None, 1, 2)}


def _in_memory_order(x: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """``x`` as it is where its memory is dense (Inductor lays activations out channels last) and holds each of
    ``rows`` groups whole (a sample: contiguous and channels-last activations both keep one together), else a
    contiguous copy: the tensor whose flat memory a site's pass reads."""
    dense = torch._prims_common.is_non_overlapping_and_dense_or_false(x)
    if not dense or (rows > 1 and x.stride(0) != x.numel() // rows):
        return x.contiguous()
    return x


def _in_groups(x: torch.Tensor, fmt: ScaledFormat) -> tuple[torch.Tensor, int, bool]:
    """``x`` in the memory order a scaled format's pass reads (``_in_memory_order``; a row's MX blocks run along
    its values in their logical order, which only a contiguous ``x`` lays out), its rows, and whether a row ends
    in a shorter block: a branch of the traced kernel that a direct call of it (precsearch.formats.runner) would
    not check again, so a kernel of its own."""
    rows, cols = fmt.rows_columns(x.shape)
    x = x.contiguous() if fmt.block else _in_memory_order(x, rows)
    return x, rows, bool(fmt.block) and cols % fmt.block != 0


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.as_strided((x.numel(),), (1,))


def _laid_out(x: torch.Tensor, nbytes: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shape and strides of a site pass's first result over ``x`` (in memory order): ``x``'s, byte planes
    stacked first."""
    return (tuple(x.shape), x.stride()) if nbytes != 2 else ((2, *x.shape), (x.numel(), *x.stride()))


@torch.library.custom_op("precsearch::round_site", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def round_site(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, rounding: str,
               nbytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A site's rounding in one pass, as the eager runtime's kernels round: ``x`` rounded by ``row`` (float32)
    or, with ``nbytes``, the codes of the rounded values (uint8; 2 bytes: byte planes stacked first); and its
    [overflowed, unencodable] counts. Opaque to Inductor: fused with the model's own kernels, the counts made it
    write the rounded values, and the values before and after each op, as float32 buffers of their own."""
    x = _in_memory_order(x)
    values, counts = run_kernel(_SITE_KERNELS[rounding, nbytes], _flat(x), row, seed)
    shape, stride = _laid_out(x, nbytes)
    return values.as_strided(shape, stride), counts


@round_site.register_fake
def _(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, rounding: str,
      nbytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    shape, stride = _laid_out(_in_memory_order(x), nbytes)
    return (x.new_empty_strided(shape, stride, dtype=torch.float32 if nbytes is None else torch.uint8),
            x.new_empty(2, dtype=torch.int32))


def _scaled_rounded(flat: torch.Tensor, row: torch.Tensor, fmt: ScaledFormat, rows: int,
                    history: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """A flat tensor of ``rows`` groups in memory order divided by the scales of its groups' amaxes (a delayed
    format's: of its ``history``) and rounded (nearest), the scales, the amaxes, and how many values overflowed
    (an inf input stays inf in an element with inf: no overflow, as ``quantize_scaled`` counts), as
    ``scaled_values`` and ``quantize_scaled`` compute them."""
    scaled, scales, amax = scaled_values(flat.view(rows, -1), fmt, history)
    values, overflowed = round_nearest(scaled, row)
    if fmt.element.has_inf:
        overflowed = overflowed - scaled.isinf().sum(dtype=overflowed.dtype)
    return values, scales, amax, overflowed


@functools.lru_cache(maxsize=64)
def _scaled_site_kernel(name: str, nbytes: int | None, rows: int, padded: bool):
    """``round_site`` for a scaled format (``_scaled_rounded``): the values (or their codes), the scales, the
    amaxes and the counts. ``padded``: whether a row ends in a shorter block, a branch of the traced code that a
    direct call of the compiled kernel would not check again (``_in_groups``)."""
    fmt = get_scaled_format(name)

    def round_scaled_site(flat: torch.Tensor, row: torch.Tensor,
                          history: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        values, scales, amax, overflowed = _scaled_rounded(flat, row, fmt, rows, history)
        values, counts = _coded(values, overflowed, row, nbytes)
        return (values.reshape(-1) if nbytes != 2 else values.reshape(2, -1), scales.reshape(-1), counts,
                amax.reshape(-1))

    return labelled(f"scaled site ({name}) {_what(nbytes)}" + (" in padded rows" if padded else ""), round_scaled_site)


@torch.library.custom_op("precsearch::round_scaled_site", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def round_scaled_site(x: torch.Tensor, row: torch.Tensor, scaled: str, nbytes: int | None,
                      history: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``round_site`` for a scaled format (``scaled``, by name; a delayed one's scale from its ``history``, an
    ``AmaxHistory``'s amaxes): the values divided by their scales and rounded, or their codes, laid out as
    ``x``; the scales (``ScaledFormat.scales_shape``); the counts; and the groups' amaxes (shaped as the
    scales), which a delayed history records (``recorded``) outside the op. One compiled pass for the amaxes and
    one for the rest."""
    fmt = get_scaled_format(scaled)
    x, rows, padded = _in_groups(x, fmt)
    kernel = _scaled_site_kernel(scaled, nbytes, rows, padded)
    # (a gradient's history arrives as the leaf the backward's step passed in: its values alone)
    values, scales, counts, amax = run_kernel(kernel, _flat(x), row, *([] if history is None else [history.detach()]))
    shape, stride = _laid_out(x, nbytes)
    scales_shape = fmt.scales_shape(x.shape)
    return values.as_strided(shape, stride), scales.reshape(scales_shape), counts, amax.reshape(scales_shape)


@round_scaled_site.register_fake
def _(x: torch.Tensor, row: torch.Tensor, scaled: str, nbytes: int | None,
      history: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    fmt = get_scaled_format(scaled)
    x = _in_groups(x, fmt)[0]
    shape, stride = _laid_out(x, nbytes)
    scales_shape = fmt.scales_shape(x.shape)
    return (x.new_empty_strided(shape, stride, dtype=torch.float32 if nbytes is None else torch.uint8),
            x.new_empty(scales_shape), x.new_empty(2, dtype=torch.int32), x.new_empty(scales_shape))


@functools.lru_cache(maxsize=64)
def _overflow_kernel(rounding: str, scaled: str | None, rows: int, padded: bool):
    """How many values of a flat tensor overflow when rounded by ``row`` (a scaled format's element,
    ``scaled``, in ``rows`` rows, ``padded``: ``_in_groups``), as ``round_site`` and ``round_scaled_site`` count
    them; the values are never written."""
    fmt = get_scaled_format(scaled) if scaled is not None else None

    def count_overflows(flat: torch.Tensor, row: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        if fmt is None:
            overflowed = round_values(flat, row, seed, rounding, in_floats=True)[1]
        else:
            overflowed = _scaled_rounded(flat, row, fmt, rows)[3]
        return overflowed.to(torch.int32).reshape(1)

    return labelled(f"site counted ({scaled or rounding})" + (" in padded rows" if padded else ""), count_overflows)


@torch.library.custom_op("precsearch::count_overflows", mutates_args=())
def count_overflows(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, rounding: str,
                    scaled: str | None) -> torch.Tensor:
    """How many of ``x``'s values overflow when rounded by ``row`` (``rounding``; ``scaled``: a scaled format by
    name), counted as ``round_site`` (or ``round_scaled_site``) counts them, in one pass that writes no value:
    for a gradient that arrives rounded alike (``OpSites.gradient_from``), which rounding again leaves as it
    is but counts again, as the eager runtime does (int32, 1 element)."""
    x, rows, padded = (_in_memory_order(x), 1, False) if scaled is None else _in_groups(x, get_scaled_format(scaled))
    return run_kernel(_overflow_kernel(rounding, scaled, rows, padded), _flat(x), row, seed)


@count_overflows.register_fake
def _(x: torch.Tensor, row: torch.Tensor, seed: torch.Tensor, rounding: str, scaled: str | None) -> torch.Tensor:
    return x.new_empty(1, dtype=torch.int32)


def _or_empty(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A custom op returns tensors: an empty one for a gradient not asked for."""
    return like.new_empty(0) if grad is None else grad.contiguous()


@torch.library.custom_op("precsearch::conv_backward_of_codes", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def conv_backward_of_codes(grad_out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
                           scaled: str | None, row: torch.Tensor, weight: torch.Tensor, stride: list[int],
                           padding: list[int], dilation: list[int], groups: int, nbytes: int, rows: int,
                           channels: int, need_input: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A convolution's input and weight gradients from its input's codes, a slice at a time
    (precsearch.runtime.sliced.conv_backward_in_slices): opaque to Inductor, which would otherwise decode the
    whole input, and fuse its decoding with its neighbours' into kernels that hold them all at once."""
    slices = _CodesInSlices(codes, row, nbytes, scales, scaled)
    grads = conv_backward_in_slices(grad_out, slices, Stored(weight), ConvGeometry(stride, padding, dilation, groups),
                                    slices.shape, weight.shape, rows, channels, need_input, need_weight)
    return _or_empty(grads[0], grad_out), _or_empty(grads[1], grad_out)


@conv_backward_of_codes.register_fake
def _(grad_out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, scaled: str | None, row: torch.Tensor,
      weight: torch.Tensor, stride: list[int], padding: list[int], dilation: list[int], groups: int, nbytes: int,
      rows: int, channels: int, need_input: bool, need_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    shape = codes.shape if nbytes == 1 else codes.shape[1:]
    return grad_out.new_empty(shape if need_input else (0,)), grad_out.new_empty(weight.shape if need_weight else (0,))


@torch.library.custom_op("precsearch::batch_norm_backward_of_codes", mutates_args=(),
                         tags=(torch.Tag.flexible_layout,))
def batch_norm_backward_of_codes(grad_out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None,
                                 scaled: str | None, row: torch.Tensor, weight: torch.Tensor | None,
                                 mean: torch.Tensor, invstd: torch.Tensor, eps: float, nbytes: int, rows: int,
                                 need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training batch norm's gradients from its input's codes, a slice at a time
    (precsearch.runtime.sliced.batch_norm_backward_in_slices), opaque to Inductor as ``conv_backward_of_codes``."""
    grads = batch_norm_backward_in_slices(grad_out, _CodesInSlices(codes, row, nbytes, scales, scaled), weight, mean,
                                          invstd, eps, rows, need)
    return tuple(_or_empty(grad, grad_out) for grad in grads)  # type: ignore[return-value]


@batch_norm_backward_of_codes.register_fake
def _(grad_out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, scaled: str | None,
      row: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor, invstd: torch.Tensor, eps: float,
      nbytes: int, rows: int, need: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shapes = (grad_out.shape, mean.shape, mean.shape)
    return tuple(grad_out.new_empty(shape if wanted else (0,)) for shape, wanted in zip(shapes, need, strict=True))
