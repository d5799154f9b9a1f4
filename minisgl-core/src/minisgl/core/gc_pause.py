"""Python's cyclic garbage collector held off while the engine loads.

Importing torch and transformers, building the model and importing torch.compile's stack make a
few hundred thousand Python objects that live as long as the engine. The collector's full passes
over them free nothing (6-30 objects each, measured) and cost ~25-230 ms each, growing with the
heap: seven of them, ~870 ms, from ``import`` to the first graphs of an ``LLM()`` on 2 cores.
``paused()`` holds the collector off around those phases. It nests and may be entered from several
threads (the compile thread loads its stack while the engine is built): the collector resumes when
the last one leaves, and only if it was on when the first came in.

When it resumes, what exists then is first moved to the collector's permanent generation
(``gc.freeze``), which no collection traverses. Else the first collections afterwards walk all of
it once more (SmolLM2's ``LLM()``: ~216,000 objects, ~100-130 ms for the first collection after
the import, 25-35 ms after the engine; a first gen-1 pass in a request's steps took 146 ms) and
every later full pass again. Cost: a garbage cycle made during a pause is never freed (~10
objects per engine, measured); an engine's own objects are still freed by reference counting
when it is dropped (four engines made and closed in one process: RSS 385 -> 388 MB)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_resume = False


@contextlib.contextmanager
def paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.freeze()
                gc.enable()
