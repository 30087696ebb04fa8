"""engine: single-device LLM inference (model, paged KV cache, block manager, scheduler, sampler).

Both the prefill and the decode workers run it. It imports neither Ray nor FastAPI.
Public API: `LLM`, `SamplingParams`, `RequestOutput`, `LLMEngine`, `EngineConfig`.
"""

from engine.engine_config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
