"""Shared fixtures: tiny Hugging Face checkpoints built once per session."""

import pytest

from tests.hf_checkpoints import CheckpointCache


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
