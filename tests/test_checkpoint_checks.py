"""A broken checkpoint is refused at load (engine.model.checkpoint_checks), naming the file, the tensor and the
reason: each hostile checkpoint below is a transformers-written Llama (or its FP8 compressed-tensors version,
benchmarks/make_random_checkpoint.py's quantize_folder) with one tensor spoilt, loaded by the real engine; and
`pdserve serve` on one fails at start with that message instead of serving NUL characters."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchclient.launcher import LaunchError
from benchmarks.make_random_checkpoint import quantize_folder
from engine import LLM
from engine.config_error import ConfigError
from engine.model.checkpoint_checks import max_scale
from tests.server_process import HALF_CPU, running_server

pytestmark = pytest.mark.timeout(180)
FP8 = torch.float8_e4m3fn
LAYER = "model.layers.0."
Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def fp8(checkpoints, tmp_path_factory) -> Path:
    """The per-channel FP8 checkpoint of a bfloat16 Llama (lm_head left bfloat16 by its `ignore` list)."""
    return quantize_folder(checkpoints.get("LlamaForCausalLM", dtype="bfloat16"), tmp_path_factory.mktemp("fp8"),
                           "channel")


def spoilt(source: Path, target: Path, change: Callable[[Tensors, dict], None]) -> Path:
    """A copy of checkpoint `source` in `target` with `change(tensors, config)` applied to its weights and config."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps(config))
    return target


def set_value(name: str, index: tuple[int, ...], value: float) -> Callable[[Tensors, dict], None]:
    def change(t: Tensors, _: dict) -> None:
        t[name][index] = value
    return change


def set_byte(name: str, index: tuple[int, int], byte: int) -> Callable[[Tensors, dict], None]:
    """One e4m3 value of `name` replaced by the bit pattern `byte`."""
    def change(t: Tensors, _: dict) -> None:
        t[name].view(torch.uint8)[index] = byte
    return change


def as_dtype(name: str, dtype: torch.dtype) -> Callable[[Tensors, dict], None]:
    def change(t: Tensors, _: dict) -> None:
        t[name] = t[name].float().clamp(-448, 448).to(dtype) if dtype.is_floating_point else t[name].to(dtype)
    return change


def static_inputs_with(bad: float) -> Callable[[Tensors, dict], None]:
    """Static per-tensor input scales (0.05 each) declared and stored, the up_proj's set to `bad`."""
    def change(t: Tensors, config: dict) -> None:
        group = config["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"].update(strategy="tensor", dynamic=False)
        for name in [n for n in t if n.endswith(".weight_scale")]:
            t[name.removesuffix("weight_scale") + "input_scale"] = torch.tensor([0.05])
        t[LAYER + "mlp.up_proj.input_scale"] = torch.tensor([bad])
    return change


SCALE_RULE = r"a scale must be finite, > 0 and <= "
# (case id, base checkpoint, change, engine keywords, the tensor at fault, the reason it gives)
CASES = [
    ("scale_nan", "fp8", set_value(LAYER + "mlp.up_proj.weight_scale", (3, 0), float("nan")), {},
     LAYER + "mlp.up_proj.weight_scale", r"is an FP8 scale of nan at row 3: " + SCALE_RULE),
    ("scale_inf", "fp8", set_value(LAYER + "self_attn.v_proj.weight_scale", (0, 0), float("inf")), {},
     LAYER + "self_attn.v_proj.weight_scale", r"is an FP8 scale of inf at row 0: " + SCALE_RULE),
    ("scale_zero", "fp8", set_value(LAYER + "self_attn.q_proj.weight_scale", (5, 0), 0.0), {},
     LAYER + "self_attn.q_proj.weight_scale", r"is an FP8 scale of 0 at row 5: " + SCALE_RULE),
    ("scale_negative", "fp8", set_value("model.layers.1.mlp.down_proj.weight_scale", (1, 0), -0.01), {},
     "model.layers.1.mlp.down_proj.weight_scale", r"is an FP8 scale of -0\.01 at row 1: " + SCALE_RULE),
    # finite in float32, but 448 times it is beyond bfloat16 (the compute dtype): no bfloat16 weight quantizes to it
    ("scale_huge", "fp8", set_value(LAYER + "self_attn.o_proj.weight_scale", (2, 0), 1e37), {},
     LAYER + "self_attn.o_proj.weight_scale",
     r"is an FP8 scale of 1e\+37 at row 2: " + SCALE_RULE + r"7\.566e\+35 .*finite torch\.bfloat16 value"),
    ("input_scale_zero", "fp8", static_inputs_with(0.0), {}, LAYER + "mlp.up_proj.input_scale",
     r"is an FP8 scale of 0: " + SCALE_RULE),
    ("weight_nan", "fp8", set_byte(LAYER + "mlp.gate_proj.weight", (2, 3), 0x7F), {},
     LAYER + "mlp.gate_proj.weight", r"holds 1 NaN e4m3 value\(s\) \(bytes 0x7F / 0xFF\)"),
    ("weight_negative_nan", "fp8", set_byte("model.layers.1.self_attn.k_proj.weight", (0, 0), 0xFF), {},
     "model.layers.1.self_attn.k_proj.weight", r"holds 1 NaN e4m3 value\(s\)"),
    ("scale_as_fp8", "fp8", as_dtype(LAYER + "mlp.down_proj.weight_scale", FP8), {},
     LAYER + "mlp.down_proj.weight_scale",
     r"is an FP8 scale stored as torch\.float8_e4m3fn; scales are float32, bfloat16, float16"),
    ("scale_as_int", "fp8", as_dtype(LAYER + "mlp.down_proj.weight_scale", torch.int32), {},
     LAYER + "mlp.down_proj.weight_scale", r"is an FP8 scale stored as torch\.int32"),
    ("fp8_embedding", "fp8", as_dtype("model.embed_tokens.weight", FP8), {}, "model.embed_tokens.weight",
     r"is stored as torch\.float8_e4m3fn, but the model keeps it in torch\.bfloat16 .*leaves this tensor "
     r"unquantized"),
    ("fp8_lm_head", "fp8", as_dtype("lm_head.weight", FP8), {}, "lm_head.weight",
     r"is stored as torch\.float8_e4m3fn, but the model keeps it in torch\.bfloat16"),
    ("fp8_norm", "fp8", as_dtype("model.norm.weight", FP8), {}, "model.norm.weight",
     r"is stored as torch\.float8_e4m3fn, but the model keeps it in torch\.bfloat16"),
    ("embedding_nan", "fp8", set_value("model.embed_tokens.weight", (7, 3), float("nan")), {},
     "model.embed_tokens.weight", r"holds 1 NaN and 0 infinite value\(s\)"),
    # a plain (float32, unquantized) checkpoint
    ("tp2_nan_in_rank1s_slice", "plain", set_value("model.layers.1.self_attn.q_proj.weight", (40, 3), float("nan")),
     {"tensor_parallel_size": 2}, "model.layers.1.self_attn.q_proj.weight", r"holds 1 NaN and 0 infinite value\(s\)"),
    ("linear_inf", "plain", set_value(LAYER + "mlp.gate_proj.weight", (0, 0), float("-inf")), {},
     LAYER + "mlp.gate_proj.weight", r"holds 0 NaN and 1 infinite value\(s\)"),
    ("overflows_float16", "plain", set_value(LAYER + "mlp.up_proj.weight", (1, 1), 1e6), {"dtype": "float16"},
     LAYER + "mlp.up_proj.weight", r"holds values beyond torch\.float16's range \(largest magnitude 1e\+06\)"),
    ("norm_as_int", "plain", as_dtype("model.norm.weight", torch.int32), {}, "model.norm.weight",
     r"is stored as torch\.int32, but the model keeps it in torch\.float32"),
]


@pytest.mark.parametrize("base, change, kwargs, tensor, reason", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_checkpoint_is_refused_naming_file_tensor_and_reason(fp8, llama, tmp_path, base, change, kwargs,
                                                                       tensor, reason):
    folder = spoilt(fp8 if base == "fp8" else llama, tmp_path / "hostile", change)
    with pytest.raises(ConfigError) as err:
        LLM(str(folder), max_model_len=64, **kwargs)
    message = str(err.value)
    assert message.startswith(f"{folder / 'model.safetensors'}: tensor {tensor!r} "), message
    assert re.search(reason, message), message


def test_the_untouched_checkpoints_load_and_the_bound_is_e4m3s(fp8, llama):
    """The checks pass what the tests' own checkpoints hold, and the scale bound is 448 * scale = the dtype's max."""
    for folder in (fp8, llama):
        out = LLM(str(folder), max_model_len=64).generate([[5, 6, 7]])
        assert len(out[0].token_ids) > 0
    assert max_scale(torch.bfloat16) * 448 == torch.finfo(torch.bfloat16).max
    assert max_scale(torch.float16) == pytest.approx(65504 / 448)


def test_serve_on_a_hostile_checkpoint_fails_at_start_with_the_reason(fp8, tmp_path):
    """`pdserve serve` exits at start with the loader's message (one line, status 2), never a 200 with NULs."""
    folder = spoilt(fp8, tmp_path / "hostile", set_value(LAYER + "mlp.up_proj.weight_scale", (3, 0), float("nan")))
    config = {"model": str(folder), "mode": "collocated", "decode": {**HALF_CPU, "workers": 1}}
    with pytest.raises(LaunchError) as err, running_server(tmp_path / "server", config):
        pytest.fail("the server started on a checkpoint with a NaN weight scale")
    log = str(err.value)
    assert "the server exited with 2" in log, log
    assert (f"pdserve: error: a worker could not start: {folder / 'model.safetensors'}: tensor "
            f"'{LAYER}mlp.up_proj.weight_scale' is an FP8 scale of nan at row 3") in log, log
