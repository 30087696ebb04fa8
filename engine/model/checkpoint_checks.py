"""Refusing a broken checkpoint at load: the rules each stored tensor meets before the model computes with it.

Owns `check_stored` (the tensor as read from the file, before it is copied into the model) and `check_loaded` (the
model's entry after the copy). A broken tensor raises ConfigError naming the file, the tensor and the reason, so
a worker fails at start instead of serving NUL characters with a healthy /health. The rules and why:

1. dtype. An entry the model keeps in 16 or 32 bits (embedding, norms, biases, an unquantized lm_head, every
   linear of a plain checkpoint) is read from float32, bfloat16 or float16 only: the copy converts between those
   exactly enough, but an FP8 (or integer) tensor there is a quantized value without its scale, which a copy would
   serve as if it were the weight. An FP8 entry is read from float8_e4m3fn only (another dtype would be rounded
   to e4m3 without its scale). A scale (`weight_scale`, `input_scale`) is float32, bfloat16 or float16: what the
   compressed-tensors layout writes (the weight's dtype, or float16 for any other) and ModelOpt's float32; an FP8
   or integer scale is not a scale either layout writes.
2. scale values. Every scale is finite and > 0: a scale multiplies every output of its rows (NaN or Inf poisons
   them, 0 zeroes them, a negative one flips their sign); a quantizer never writes one (an all-zero row gets a tiny
   positive scale). And scale * 448 (e4m3's largest magnitude) <= the compute dtype's largest finite value: a
   quantizer maps the largest magnitude of a tensor or row to 448, so a scale is amax / 448 of a weight (or an
   activation range) the compute dtype holds; a larger one cannot come from quantizing a real model, and its
   largest e4m3 value would dequantize to Inf (bfloat16 and float32: ~7.6e35; float16: 146).
3. no NaN or Inf in a weight. In e4m3 (float8_e4m3fn, no Inf) NaN is the bit patterns 0x7F and 0xFF: a byte
   equal to 127 read as int8, or to 255 read as uint8, each a max over the bytes. A 16/32-bit entry has no NaN or
   Inf after the copy (which also catches a float32 value beyond a float16 entry's range), tested with one
   `aminmax` (NaN propagates into it, Inf is its min or max). Both run on the entry's device after the copy: on
   a GPU at memory bandwidth, nothing against reading the file. On the CPU they are a second pass over the bytes,
   measured with one thread (load_weights from the page cache, median of 9, with and without the checks): the tests'
   `tiny` model (16 MB) 7.1 -> 9.9 ms, the `small-128k` shape of benchmarks/make_random_checkpoint.py (137 MB of
   bfloat16) 39 -> 69 ms, its FP8 version 43 -> 78 ms. Kept on the CPU too: milliseconds against a worker start
   of seconds, and a CPU serves only small models. Not used: `isfinite().all()` (1.5 s over 131M bfloat16 values
   on 2 threads, where aminmax took 20 ms), or a check of a sample (it would miss the one NaN of a flipped bit).
   `load_format: dummy` runs none of this: init_dummy_weights draws finite values by construction.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config_error import ConfigError

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
WIDE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a 16/32-bit entry and a scale are read from
SCALE_SUFFIXES = (".weight_scale", ".input_scale")
E4M3_NAN_INT8 = 0x7F   # +NaN (0x7F) read as int8: larger than every other byte
E4M3_NAN_UINT8 = 0xFF  # -NaN (0xFF) read as uint8: larger than every other byte


def max_scale(compute_dtype: torch.dtype) -> float:
    """The largest FP8 scale whose largest e4m3 value (448 * scale) is a finite `compute_dtype` number."""
    return torch.finfo(compute_dtype).max / E4M3_MAX


def _fail(path: Path, name: str, reason: str) -> ConfigError:
    return ConfigError(f"{path}: tensor {name!r} {reason}; the checkpoint is broken (re-export or re-quantize it)")


def check_stored(path: Path, name: str, stored: torch.Tensor, target: torch.Tensor,
                 compute_dtype: torch.dtype | None) -> None:
    """Rules 1 and 2 on the tensor `name` as read from `path` (`stored`), before it is copied into `target`;
    `compute_dtype`: the dtype its FP8 linear computes in (for a scale's bound; None for other tensors)."""
    if name.endswith(SCALE_SUFFIXES):
        _check_scale(path, name, stored, compute_dtype)
    elif target.dtype == FP8:
        if stored.dtype != FP8:
            raise _fail(path, name, f"is stored as {stored.dtype}, but config.json's quantization config declares "
                                    "it float8_e4m3fn")
    elif target.is_floating_point() and stored.dtype not in WIDE_DTYPES:
        unquantized = (" (config.json declares no FP8 quantization_config, or one that leaves this tensor "
                       "unquantized: an FP8 value without its scale is not the weight)"
                       if stored.dtype.is_floating_point else "")
        raise _fail(path, name, f"is stored as {stored.dtype}, but the model keeps it in {target.dtype} and reads it "
                                f"only from {_names(WIDE_DTYPES)}{unquantized}")


def _check_scale(path: Path, name: str, stored: torch.Tensor, compute_dtype: torch.dtype | None) -> None:
    if stored.dtype not in WIDE_DTYPES:
        raise _fail(path, name, f"is an FP8 scale stored as {stored.dtype}; scales are {_names(WIDE_DTYPES)}")
    values = stored.float().reshape(-1)
    bound = max_scale(compute_dtype or torch.float32)
    bad = ~(torch.isfinite(values) & (values > 0) & (values <= bound))
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        where = f" at row {index}" if values.numel() > 1 else ""
        raise _fail(path, name, f"is an FP8 scale of {values[index].item():.6g}{where}: a scale must be finite, "
                                f"> 0 and <= {bound:.4g} (448 times it must be a finite "
                                f"{compute_dtype or torch.float32} value)")


def check_loaded(path: Path, name: str, target: torch.Tensor, stored: torch.Tensor) -> None:
    """Rule 3 on the model's entry `target` after `stored` (the file's tensor) was copied into it."""
    if target.numel() == 0 or name.endswith(SCALE_SUFFIXES):  # scales: checked whole by check_stored
        return
    if target.dtype == FP8:
        if (int(target.view(torch.int8).max()) == E4M3_NAN_INT8
                or int(target.view(torch.uint8).max()) == E4M3_NAN_UINT8):
            nans = int(((target.view(torch.uint8) & 0x7F) == 0x7F).sum())
            raise _fail(path, name, f"holds {nans} NaN e4m3 value(s) (bytes 0x7F / 0xFF)")
        return
    if not target.is_floating_point():
        return
    low, high = torch.aminmax(target)
    if torch.isfinite(low) and torch.isfinite(high):
        return
    flat = stored.reshape(-1)
    nan, inf = int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum())
    if nan or inf:
        raise _fail(path, name, f"holds {nan} NaN and {inf} infinite value(s)")
    raise _fail(path, name, f"holds values beyond {target.dtype}'s range (largest magnitude "
                            f"{flat.float().abs().max().item():.4g}), which the model's {target.dtype} turns into "
                            "infinities")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
