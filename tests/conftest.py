"""Shared fixtures: tiny Hugging Face checkpoints built once per session.

Without a GPU, Triton kernels run in Triton's interpreter (set before any kernel module is imported)."""

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():  # before anything imports triton (transformers does)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.hf_checkpoints import CheckpointCache  # noqa: E402


@pytest.fixture(autouse=True)
def free_gpu_memory():
    """An engine sizes its KV cache from the GPU's free memory: hand the next test what this one's engines held
    (they may sit in reference cycles, and torch's allocator keeps freed memory cached)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointCache:
    return CheckpointCache(tmp_path_factory)


@pytest.fixture(scope="session")
def llama(checkpoints):
    """A tiny random Llama checkpoint written by transformers (varied greedy output)."""
    return checkpoints.get("LlamaForCausalLM")


@pytest.fixture(scope="session")
def reference(llama):
    """The single engine on `llama`: what served outputs must equal."""
    from engine import LLM
    return LLM(str(llama))
