"""The collector held off while the engine loads (minisgl.core.gc_pause): it nests, spans threads,
restores the state it found, an engine's start runs no full collection, and what the start built
is frozen out of later collections."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path

from minisgl.core.gc_pause import paused


def test_paused_nests_and_restores() -> None:
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer phase is still on
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()


def test_paused_resumes_when_the_last_thread_leaves() -> None:
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with paused():
        t.start()
        assert entered.wait(10)
    assert not gc.isenabled()  # the other thread is still inside
    release.set()
    t.join(10)
    assert gc.isenabled()


PROBE = """
import gc, json, sys
full = []
gc.callbacks.append(lambda phase, info: full.append(1)
                    if phase == "stop" and info["generation"] == 2 else None)
from minisgl.core import LLM
llm = LLM(model=sys.argv[1], compile="off")
during = len(full)
class Cycle:
    pass
a, b = Cycle(), Cycle()
a.other, b.other = b, a
del a, b
tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
print(json.dumps({"during": during, "enabled": gc.isenabled(), "freed": gc.collect(),
                  "tracked": tracked, "frozen": frozen}))
"""


def test_an_engine_starts_without_full_collections(tiny_llama: Path) -> None:
    """Importing torch alone ran two full passes here (the import and LLM() ran seven, ~870 ms,
    for SmolLM2); afterwards the collector is on and frees new cycles, while the objects of the
    import and the start (torch's alone are ~200,000) sit in the permanent generation, where no
    collection walks them."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_llama)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["during"] == 0
    assert got["enabled"] is True
    assert got["freed"] >= 2
    assert got["frozen"] > 50_000
    assert got["tracked"] < got["frozen"] // 10
