"""Test-session setup that must happen before any test module imports triton or torch."""

import os

# Triton kernels run here only in the interpreter, and the variable must be set before the
# module defining a kernel is imported. Set for the whole session (and the torchrun workers
# it starts), so `algorithm.loss_impl=auto` exercises the fused kernel on CPU too.
os.environ["TRITON_INTERPRET"] = "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: ~12 s or more on 2 cores (its module fixtures counted); `make test` runs it, `make test-fast` does not",
    )
