"""engine: single-device LLM inference (model, paged KV cache, block manager, scheduler, sampler).

Both the prefill and the decode workers run it. It imports neither Ray nor FastAPI.
Public API: `LLM`, `SamplingParams`, `RequestOutput`, `LLMEngine`, `EngineConfig`. Imports are lazy so that the
torch-free modules (sampling_params, request, config, tokenizer, kv_layout) load without torch, e.g. in the
coordinator.
"""

from importlib import import_module

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.engine_config",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
