"""The CPU KV pool takes memory where K/V are written, not its whole budget at startup."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc/self/status")

# Prints the process's anonymous resident MiB: at start, after a 720 MiB pool, after writing
# 1,000 tokens (their pages: 30 layers x K,V x 3 heads x 32 pages of 4 KiB = 22.5 MiB), before
# and after an engine with a 1 GiB pool (argv[1]: a tiny model) is built and serves a prompt.
# Checks the values too.
PROBE = """
import sys, torch
from minisgl.core.kvcache import KVPool

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) / 1024

torch.manual_seed(0)
start = anon()
pool = KVPool(30, 2048, 16, 3, 64, torch.bfloat16, torch.device("cpu"))
assert pool.num_bytes == 720 << 20
built = anon()
assert all(float(t[:, ::997].abs().sum()) == 0 for t in pool.k + pool.v), "not zeros"
slots = torch.arange(20_000, 21_000)
k, v = torch.randn(1000, 3, 64), torch.randn(1000, 3, 64)
for layer in range(30):
    pool.write(layer, slots, k, v)
got_k, got_v = pool.read(29, slots)
assert torch.equal(got_k, k.transpose(0, 1).bfloat16()), "K differs"
assert torch.equal(got_v, v.transpose(0, 1).bfloat16()), "V differs"
assert float(pool.k[29][:, :20_000].abs().sum()) == 0, "written outside the slots"
written = anon()
del pool

from minisgl.core.llm import LLM
from minisgl.core.sampling_params import SamplingParams
before = anon()
llm = LLM(sys.argv[1], compile="off", kv_cache_memory=1 << 30)
out = llm.generate([list(range(3, 60))], SamplingParams(max_tokens=4, temperature=0))
assert len(out[0].token_ids) == 4
assert llm.engine.kv.num_bytes > 900 << 20
print(start, built, written, before, anon())
"""


def test_pool_is_resident_only_where_written(tiny_llama: Path) -> None:
    """torch.zeros made the whole budget resident (720 MiB here) before any request; the pool's
    anonymous maps are zeroed by the kernel page by page as K/V land: the pool costs the pages
    written, it holds zeros elsewhere, and an engine with a 1 GiB budget stays small."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny_llama)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    start, built, written, engine_before, engine_after = (float(x) for x in
                                                          out.stdout.split()[-5:])
    assert built - start < 16, (start, built)
    assert 20 < written - built < 40, (built, written)
    assert engine_after - engine_before < 256, (engine_before, engine_after)


def test_a_pool_larger_than_the_machine_is_refused(tiny_llama: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Lazily resident, a pool past the machine's memory would start and die later: the engine
    refuses it naming the setting, and warns where it exceeds what is available now."""
    from minisgl.core import kvcache
    from minisgl.core.config import EngineConfig
    from minisgl.core.engine import Engine

    info = kvcache.memory_info()
    assert info is not None and 0 < info[1] <= info[0]
    with pytest.raises(ValueError, match=r"^kv_cache_memory: the KV pool would take 1048576\.0 "
                                         r"GiB, more than this machine's"):
        Engine(EngineConfig(model=str(tiny_llama), compile="off", kv_cache_memory=1 << 50))
    with pytest.raises(ValueError, match=r"^num_pages: the KV pool would take"):
        Engine(EngineConfig(model=str(tiny_llama), compile="off", num_pages=1 << 40))
    # between available and total: a warning, and the engine is built
    per_page = 2 * 2 * 16 * 2 * 16 * 2  # layers, K/V, page, kv heads, head dim, bf16
    kvcache.check_pool_fits(info[0], "kv_cache_memory")
    assert "may kill the process" in caplog.text or info[0] <= info[1]
    engine = Engine(EngineConfig(model=str(tiny_llama), compile="off", num_pages=64))
    assert engine.kv.num_bytes == 64 * per_page
