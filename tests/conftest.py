"""Fixtures shared by the CPU and GPU tests."""

import os
import secrets

import pytest


@pytest.fixture
def seed(request):
    """A fresh seed every run (TOKENYARD_TEST_SEED pins one); printed so a failure can be replayed."""
    value = int(os.environ.get("TOKENYARD_TEST_SEED", secrets.randbelow(2**31)))
    print(f"\n{request.node.name}: seed {value} (replay with TOKENYARD_TEST_SEED={value})")
    return value
