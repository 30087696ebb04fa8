"""engine: single-device LLM inference (model, paged KV cache, block manager, scheduler, sampler).

Both the prefill and the decode workers run it. It imports neither Ray nor FastAPI.
Public API: `LLM`, `SamplingParams`, `RequestOutput`, `LLMEngine`, `EngineConfig`. Imports are lazy so that the
torch-free modules (core/, text/, model/model_config.py, kv_layout.py, load.py) load without torch, e.g. in the
coordinator.

Folders: `model/` the decoder, its layers and weight loading; `core/` requests, scheduler, block manager;
`runner/` one step on the device (inputs, KV cache tensor, CUDA graphs); `sampling/` sampler, logits processing,
grammar masks; `text/` tokenizer and detokenizer; `kernels/` Triton kernels. At the top: the entry points
(`LLM`, `LLMEngine`, `AsyncEngine`), LLMEngine's mixins (`handoff_blocks`, `grammar_holding`, `host_kv`,
`engine_report`), the engine's config, the KV layout contract, the embedded `tiny` model.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.engine_config",
    "RequestOutput": "engine.core.outputs",
    "SamplingParams": "engine.core.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
