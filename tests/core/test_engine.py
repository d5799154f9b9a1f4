"""Engine, scheduler and LLM API behaviour on a tiny random Llama (HF greedy as the reference)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from minisgl.core import LLM, SamplingParams
from minisgl.core.request import Req

from .conftest import hf_greedy, save_tiny_llama, write_eos

PROMPTS = [[5, 9, 17, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7], [100, 3, 60, 60, 2, 11]]


def all_free(llm: LLM) -> bool:
    """Nothing running; every page is free once the prefix cache is cleared."""
    e = llm.engine
    llm.scheduler.check_integrity()
    if e.allocator.num_free + llm.scheduler.cache.total_pages != e.allocator.capacity:
        return False
    llm.scheduler.clear_cache()
    return (e.allocator.num_free == e.allocator.capacity
            and e.table.num_free == llm.config.max_running_requests
            and not llm.scheduler.has_work())


@pytest.fixture(scope="module")
def llm(tiny_llama: Path, attention_backend: str) -> LLM:
    return LLM(model=str(tiny_llama), dtype="float32", attention_backend=attention_backend,
               page_size=4, num_pages=64, max_running_requests=8)


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def test_greedy_matches_hf_and_frees_pages(llm: LLM, hf_tiny: object) -> None:
    outs = llm.generate(PROMPTS, greedy(12))
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == hf_greedy(hf_tiny, prompt, 12)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt
    assert all_free(llm)


def test_more_requests_than_slots_queue_and_complete(llm: LLM, hf_tiny: object) -> None:
    prompts = [[(7 * i + j) % 120 + 3 for j in range(1 + i % 5)] for i in range(20)]
    outs = llm.generate(prompts, greedy(6))
    assert [o.token_ids for o in outs] == [hf_greedy(hf_tiny, p, 6) for p in prompts]
    assert all_free(llm)


def test_per_prompt_sampling_params_and_max_tokens(llm: LLM) -> None:
    outs = llm.generate(PROMPTS[:3], [greedy(1), greedy(5), greedy(3)])
    assert [len(o.token_ids) for o in outs] == [1, 5, 3]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS[:3], [greedy(1)])
    assert all_free(llm)


def test_stop_token_ids_and_ignore_eos(llm: LLM, hf_tiny: object) -> None:
    ref = hf_greedy(hf_tiny, PROMPTS[1], 12)
    stop = ref[4]
    first = ref.index(stop)
    out = llm.generate([PROMPTS[1]], greedy(12, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    assert all_free(llm)


def test_any_of_several_eos_ids_stops_unless_ignore_eos(tmp_path: Path, hf_tiny: object,
                                                       attention_backend: str) -> None:
    ref = hf_greedy(hf_tiny, PROMPTS[0], 10)
    path = save_tiny_llama(tmp_path / "m")  # same seed: same weights as tiny_llama
    write_eos(path, [127, ref[3], 126])  # generation_config may list several EOS ids
    llm = LLM(model=str(path), dtype="float32", attention_backend=attention_backend,
              num_pages=32, page_size=4)
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0))[0]
    assert stopped.token_ids == ref[: ref.index(ref[3]) + 1]
    assert stopped.finish_reason == "stop"
    ignored = llm.generate([PROMPTS[0]], greedy(10))[0]
    assert ignored.token_ids == ref and ignored.finish_reason == "length"
    shutil.rmtree(path)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompts": [[]]}, "prompt"),
        ({"prompts": [[1] * 300]}, "prompt"),  # longer than the 256-token context
        ({"prompts": [[1, 128]]}, "prompt"),  # vocabulary is 128
        ({"prompts": [[1, -1]]}, "prompt"),
        ({"params": {"temperature": -0.5}}, "temperature"),
        ({"params": {"top_p": 0.0}}, "top_p"),
        ({"params": {"top_p": 1.5}}, "top_p"),
        ({"params": {"top_k": 0}}, "top_k"),
        ({"params": {"top_k": -2}}, "top_k"),
        ({"params": {"max_tokens": 0}}, "max_tokens"),
        ({"params": {"min_p": 2.0}}, "min_p"),
        ({"params": {"max_tokens": 100_000}}, "max_tokens"),  # more pages than the pool has
    ],
)
def test_bad_input_raises_value_error_naming_field(llm: LLM, hf_tiny: object,
                                                    kwargs: dict, field: str) -> None:
    prompts = kwargs.get("prompts", [[1, 2, 3]])
    good = [[4, 5, 6]]
    with pytest.raises(ValueError, match=field):
        params = SamplingParams(**kwargs.get("params", {}))
        llm.generate(good + prompts, params)  # the good prompt must not be half-submitted
    assert all_free(llm)
    out = llm.generate(good, greedy(4))[0]  # later requests still work
    assert out.token_ids == hf_greedy(hf_tiny, good[0], 4)
    assert all_free(llm)


def test_string_prompt_needs_tokenizer(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt: .*no tokenizer"):
        llm.generate(["hello"])


def test_abort_frees_pages(llm: LLM) -> None:
    sched = llm.scheduler
    reqs = [Req(p, greedy(50)) for p in PROMPTS]
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        sched.step()
    assert llm.engine.allocator.num_free < llm.engine.allocator.capacity
    for r in reqs:
        assert sched.abort(r.rid) is r
        assert r.finish_reason == "abort"
        assert all(t >= 0 for t in r.output_ids)  # no placeholder of an in-flight step left
    assert sched.drain() == []  # an in-flight step's tokens for aborted requests are dropped
    assert all_free(llm)


def test_pool_sized_from_memory_budget(tiny_llama: Path, attention_backend: str) -> None:
    # per page: 2 layers x (K, V) x 4 tokens x 2 kv heads x 16 dims x 4 bytes = 2048 bytes
    llm = LLM(model=str(tiny_llama), dtype="float32", attention_backend=attention_backend,
              page_size=4, kv_cache_memory=2048 * 40)
    assert llm.engine.kv.num_pages == 40
    assert llm.engine.kv.num_bytes == 2048 * 40


def test_default_dtype_is_bf16_on_cpu(tiny_llama: Path, attention_backend: str) -> None:
    llm = LLM(model=str(tiny_llama), attention_backend=attention_backend, num_pages=16)
    assert llm.engine.dtype == torch.bfloat16
    assert llm.engine.kv.k[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(tiny_llama), dtype="float16", num_pages=16)


def test_unknown_option_is_rejected(tiny_llama: Path) -> None:
    with pytest.raises(TypeError, match="page_sise"):
        LLM(model=str(tiny_llama), page_sise=4)


def test_a_stalled_scheduler_raises_instead_of_hanging(llm: LLM, monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(llm.scheduler.kv, "admit", lambda req: False)  # nothing can ever start
    with pytest.raises(RuntimeError, match="stalled"):
        llm.generate([PROMPTS[0]], greedy(4))
    monkeypatch.undo()
    assert all_free(llm)  # the stuck request was aborted on the way out
    assert llm.generate([PROMPTS[0]], greedy(2))[0].finish_reason == "length"


def test_threads_option_sets_torch_threads_and_close_restores(tiny_llama: Path, hf_tiny: object
                                                                ) -> None:
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2
    llm = LLM(model=str(tiny_llama), dtype="float32", threads=want, num_pages=32)
    try:
        assert torch.get_num_threads() == want
        out = llm.generate([PROMPTS[0]], greedy(6))[0]
        assert out.token_ids == hf_greedy(hf_tiny, PROMPTS[0], 6)  # same answer, other threads
    finally:
        llm.close()
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        LLM(model=str(tiny_llama), threads=0, num_pages=16)


def test_cpu_threads_split_among_local_ranks(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
                                             ) -> None:
    from minisgl.core.config import EngineConfig
    from minisgl.core.tp import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("minisgl.core.tp.physical_cores", lambda: 8)
    one = EngineConfig(model=str(tiny_llama))
    two = EngineConfig(model=str(tiny_llama), tp_size=2)
    assert cpu_threads(one, 1) is None  # torch's own default
    assert cpu_threads(two, 2) == 4
    assert cpu_threads(EngineConfig(model=str(tiny_llama), tp_size=3), 3) == 2
    assert cpu_threads(EngineConfig(model=str(tiny_llama), tp_size=2, threads=3), 2) == 3
    assert cpu_threads(EngineConfig(model=str(tiny_llama), device="cuda", tp_size=2), 2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpu_threads(two, 2) is None  # the user's OpenMP setting wins over the split


def test_physical_cores_count_smt_siblings_once(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake sysfs: 2 packages x 2 cores x 2 hardware threads, of which the process may use
    CPUs 0-5 (both threads of cores (0, 0), (0, 1), (1, 0)); CPU 6 has no topology files."""
    from minisgl.core.tp import physical_cores

    layout = {0: ("0", "0"), 1: ("0", "0"), 2: ("0", "1"), 3: ("0", "1"), 4: ("1", "0"),
              5: ("1", "0"), 7: ("1", "1")}
    for cpu, (package, core) in layout.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(package + "\n")
        (topology / "core_id").write_text(core + "\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(6)))
    assert physical_cores(str(tmp_path)) == 3
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 6})
    assert physical_cores(str(tmp_path)) == 2  # core (0, 0) and CPU 6 on its own
    assert physical_cores() >= 1  # this machine's


def test_token_slice_equals_slicing_all_ids() -> None:
    """Every [start, end) of prompt + output, across the boundary and empty ranges included."""
    req = Req(prompt_ids=[5, 6, 7], params=SamplingParams())
    for output in ([], [8], [8, 9, 10]):
        req.output_ids = list(output)
        n = len(req.all_ids)
        for start in range(n + 1):
            for end in range(start, n + 1):
                assert req.token_slice(start, end) == req.all_ids[start:end], (output, start, end)
