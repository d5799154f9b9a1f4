"""The bench's llama.cpp probe: a child process tries llama-cpp-python with its default buffer
types (on AMX CPUs they crashed it); here a stand-in ``llama_cpp`` package, first on the child's
path, that either generates or dies of SIGSEGV, as the real one did."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.server import bench

FAKE = '''
import os, signal

class Llama:
    def __init__(self, model_path, **kw):
        assert os.path.exists(model_path) and kw["n_threads"] == 2
    def generate(self, tokens, **kw):
        if os.environ.get("FAKE_LLAMA_CRASH"):
            os.kill(os.getpid(), signal.SIGSEGV)
        yield from tokens
'''


@pytest.fixture
def fake_llama(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return str(gguf)


@pytest.mark.parametrize("crash", [False, True])
def test_probe_reports_a_crash_of_the_child(fake_llama: str, crash: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "_cpu_has_amx", lambda: True)
    if crash:
        monkeypatch.setenv("FAKE_LLAMA_CRASH", "1")
    assert bench._llama_cpp_extra_buffers_work(fake_llama, 2) is not crash


def test_no_probe_without_amx(fake_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "_cpu_has_amx", lambda: False)
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "1")  # would crash: not run at all

    def no_child(*args: object, **kwargs: object) -> None:
        raise AssertionError("probed without AMX")

    monkeypatch.setattr("subprocess.run", no_child)
    assert bench._llama_cpp_extra_buffers_work(fake_llama, 2)
