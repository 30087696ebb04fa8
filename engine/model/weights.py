"""Loading a Hugging Face safetensors checkpoint into an already-built model.

Owns: finding the checkpoint's files (`model.safetensors`, the shards of `model.safetensors.index.json`, or any
`*.safetensors`), and copying each stored tensor into the model parameter or buffer of the same Hugging Face name,
one tensor at a time (never the whole checkpoint in memory), converting dtype and device on the copy. For a CUDA
model whole tensors are read straight into device memory through pinned buffers (engine.model.staged_reads).
The model owns its parameters (dtype, device, names); this module only fills them.
Names the model must match: `model.state_dict()` keys are exactly the checkpoint's tensor names.
Tensor parallelism: given `slices` (engine.model.parallel.TPLayout.slices), a rank reads only its part of each cut
tensor through `safe_open(...).get_slice` (memory-mapped), never the whole tensor; a part shorter than the
parameter (the padded tail of the last vocabulary shard) leaves the rest zero. `LoadStats` counts what was read.
`init_dummy_weights` (load_format "dummy") fills the model with random values generated on its device instead.
FP8 linears (engine.model.fp8_linear) are filled by the same names (`weight` e4m3, `weight_scale`, `input_scale`);
a scale may be stored as a scalar or a column of the same values. Each tensor read is checked where it is read
(engine.model.checkpoint_checks: its dtype, an FP8 scale's value, no NaN or Inf), so a broken checkpoint fails here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config_error import ConfigError
from engine.kv_quant import is_kv_scale
from engine.model.checkpoint_checks import SCALE_SUFFIXES, check_loaded, check_stored
from engine.model.staged_reads import StagedReader

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"
TIED_EMBED = "model.embed_tokens.weight"
DUMMY_SCALE = 1e-3


@dataclass
class LoadStats:
    """What load_weights materialised from the checkpoint: tensors read and their bytes (slices only, with TP)."""

    tensors: int = 0
    bytes: int = 0


class WeightsError(ConfigError):
    """The checkpoint's tensors do not match the model: names the folder, file or tensor at fault (a ConfigError,
    as a broken tensor's refusal by engine.model.checkpoint_checks is: one error for a checkpoint that cannot load)."""


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in load order; every shard the index names must exist."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (folder / shard).is_file():
                raise WeightsError(f"{index}: shard {shard!r} is listed but {folder / shard} does not exist")
        return [folder / shard for shard in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder}: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file")
    return files


def _read(f, name: str, target: torch.Tensor, cut: tuple[int, int, int, int] | None, path: Path) -> torch.Tensor:
    """The stored tensor `name`, or only its `cut` (dim, start, stop, full size) part, checked against `target`.
    An FP8 scale (`*_scale`) may be stored in any shape of the same values ([] or [1]; [out] or [out, 1])."""
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    expected = tuple(target.shape)
    if cut is not None:
        dim, start, stop, full = cut
        expected = expected[:dim] + (full,) + expected[dim + 1:]
    if shape != expected and name.endswith(SCALE_SUFFIXES) and _squeezed(shape) == _squeezed(expected):
        whole = f.get_tensor(name).reshape(expected)
        return whole if cut is None else whole.narrow(dim, start, stop - start)
    if shape != expected:
        raise WeightsError(f"{path}: tensor {name!r} has shape {shape} in the checkpoint but {expected} in the "
                           "model" + (" (before the tensor-parallel cut)" if cut is not None else ""))
    if cut is None:
        return sl[:]
    return sl[start:stop] if dim == 0 else sl[:, start:stop]


def _read_staged(staged: StagedReader, name: str, target: torch.Tensor, path: Path,
                 compute_dtype: torch.dtype | None) -> torch.Tensor:
    """Tensor `name`, whole, on `target`'s device through `staged` (its dtype checked from the header first)."""
    dtype, shape = staged.meta(name)
    if shape != tuple(target.shape):
        raise WeightsError(f"{path}: tensor {name!r} has shape {shape} in the checkpoint but {tuple(target.shape)} in "
                           "the model")
    check_stored(path, name, torch.empty(shape, dtype=dtype, device="meta"), target, compute_dtype)
    return staged.read(name, target)


def _device(targets: Mapping[str, torch.Tensor]) -> torch.device:
    return next(t.device for t in targets.values() if t.is_cuda)


def _compute_dtype(model: torch.nn.Module, name: str) -> torch.dtype | None:
    """The dtype the FP8 linear owning scale `name` computes in (Fp8Linear.out_dtype); None for other tensors."""
    if not name.endswith(SCALE_SUFFIXES):
        return None
    return getattr(model.get_submodule(name.rsplit(".", 1)[0]), "out_dtype", None)


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _check_tied_head(path: Path, targets: dict[str, torch.Tensor],
                     slices: Mapping[str, tuple[int, int, int, int]]) -> None:
    """A tied model may ignore a stored lm_head.weight only if it is the embedding (else the config is wrong)."""
    embed = targets.get(TIED_EMBED)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        cut = slices.get(TIED_HEAD)
        head = f.get_tensor(TIED_HEAD) if cut is None else f.get_slice(TIED_HEAD)[cut[1]:cut[2]]
        if embed is not None and cut is not None:
            embed = embed[: cut[2] - cut[1]]
    if embed is None or head.shape != embed.shape or not torch.equal(head.to(embed.dtype).to(embed.device), embed):
        raise WeightsError(f"{path}: tensor {TIED_HEAD!r} differs from {TIED_EMBED!r}, but the model ties them "
                           "(tie_word_embeddings); the checkpoint's config and weights disagree")


def load_weights(model: torch.nn.Module, folder: str | Path,
                 slices: Mapping[str, tuple[int, int, int, int]] | None = None) -> LoadStats:
    """Copy every checkpoint tensor into `model` in place; every model entry must be filled exactly.

    Entries that share storage with a filled entry (tied embeddings in a model that keeps `lm_head.weight`
    as an alias) count as filled. A stored `lm_head.weight` that a tied model lacks is skipped if it equals the
    embedding. Raises `WeightsError` on an unexpected or missing tensor or a shape mismatch, ConfigError on a
    broken tensor (engine.model.checkpoint_checks; WeightsError is one too).
    `slices`: tensor name -> (dim, start, stop, full size) of the part to read (tensor parallelism).
    """
    slices = slices or {}
    stats = LoadStats()
    targets = model.state_dict()
    loaded: set[str] = set()
    tied_head_file: Path | None = None
    on_cuda = any(t.is_cuda for t in targets.values())
    with torch.no_grad():
        for path in checkpoint_files(folder):
            with safe_open(str(path), framework="pt", device="cpu") as f, \
                    (StagedReader(path, _device(targets)) if on_cuda else nullcontext()) as staged:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if name.endswith("rotary_emb.inv_freq") or is_kv_scale(name):  # KV scales: engine.kv_quant
                        continue
                    if name == TIED_HEAD and name not in targets:
                        tied_head_file = path
                        continue
                    target = targets.get(name)
                    if target is None:
                        hint = (" (an FP8 scale: config.json declares no FP8 quantization_config, or its ignore "
                                "list names this linear)" if name.endswith(SCALE_SUFFIXES) else "")
                        raise WeightsError(f"{path}: unexpected tensor {name!r} (the model has no such entry){hint}")
                    cut = slices.get(name)
                    if staged is not None and cut is None and target.is_cuda and not name.endswith(SCALE_SUFFIXES):
                        part = _read_staged(staged, name, target, path, _compute_dtype(model, name))
                    else:
                        part = _read(f, name, target, cut, path)
                        check_stored(path, name, part, target, _compute_dtype(model, name))
                    stats.tensors += 1
                    stats.bytes += part.numel() * part.element_size()
                    if part is target:  # read in place (engine.model.staged_reads)
                        pass
                    elif part.shape == target.shape:
                        target.copy_(part)
                    else:  # the padded tail of the last vocabulary shard
                        target.zero_()
                        target.narrow(cut[0], 0, part.shape[cut[0]]).copy_(part)
                    check_loaded(path, name, target, part)
                    loaded.add(name)
    filled = {targets[name].data_ptr() for name in loaded}
    missing = [n for n in targets if n not in loaded and targets[n].data_ptr() not in filled]
    if missing:
        raise WeightsError(f"{folder}: checkpoint lacks {len(missing)} tensor(s) the model needs: {missing}")
    if tied_head_file is not None:
        _check_tied_head(tied_head_file, targets, slices)
    return stats


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights generated on the model's device (load_format "dummy", for benchmarks of a model shape
    without its checkpoint): norm weights 1, everything else uniform in [-1e-3, 1e-3] (as vLLM's dummy format)."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(SCALE_SUFFIXES):  # FP8: weights in [-1, 1] scaled by 1e-3, as the 16-bit range above
                p.fill_(DUMMY_SCALE if name.endswith(".weight_scale") else 1.0)
                continue
            gen = torch.Generator(device=p.device).manual_seed(seed + i)
            if p.dtype == torch.float8_e4m3fn:
                p.copy_(torch.empty(p.shape, device=p.device).uniform_(-1.0, 1.0, generator=gen))
            else:
                p.uniform_(-1e-3, 1e-3, generator=gen)
