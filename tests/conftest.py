"""Shared fixtures: tiny Hugging Face checkpoints built once per session."""

import pytest

from tests.hf_checkpoints import CheckpointCache


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> CheckpointCache:
    return CheckpointCache(tmp_path_factory)
