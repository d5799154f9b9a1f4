"""Shared fixtures. Tests run with MINISGL_STRICT_PLUGINS=1 (plugin import errors fail loudly)
and, unless MINISGL_COMPILE says otherwise, eager decode steps."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MINISGL_STRICT_PLUGINS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines (and servers the tests start) run eager unless the session asks for compiled decode
# steps: nox's tests-compiled sessions set MINISGL_COMPILE=wait.
os.environ.setdefault("MINISGL_COMPILE", "off")


@pytest.fixture(scope="session")
def attention_backend() -> str:
    """The backend under test; the nox matrix sets MINISGL_TEST_BACKEND (default: torch)."""
    return os.environ.get("MINISGL_TEST_BACKEND", "torch")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The bundled SmolLM2-135M-Instruct as an HF directory (converted once per machine)."""
    from minisgl.core.bundled import resolve_model

    return resolve_model("smollm2")
