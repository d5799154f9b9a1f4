"""The plugin system through real entry points: installed dists, fake dists on sys.path, the CLI.

Fake distributions are ``<name>-0.1.dist-info`` folders (METADATA + entry_points.txt) next to a
plain module in a tmp dir that is put on sys.path, so importlib.metadata finds them exactly as it
finds an installed package; nothing in pluggy or importlib is mocked.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pluggy
import pytest
import torch

from minisgl.core import LLM, SamplingParams, hookspecs
from minisgl.core.plugins import KINDS, PluginManager, get_plugin_manager
from minisgl.core.registry import PluginError, Registry, UnknownNameError

FIXTURE_PKG = "minisgl-fixture-plugin"
BUILTIN = {"core": "minisgl-core", "models": "minisgl-models", "backends": "minisgl-backends"}
HOOK = "from minisgl.core import hookimpl\n"

FakeDist = Callable[..., Path]


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDist]:
    """make(package, {ep_name: module}, {module: source}) -> the dir now on sys.path."""
    modules: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(package: str, entry_points: dict[str, str], sources: dict[str, str]) -> Path:
        info = tmp_path / f"{package.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
        eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[minisgl]\n{eps}")
        for mod, src in sources.items():
            (tmp_path / f"{mod}.py").write_text(textwrap.dedent(src))
            modules.append(mod)
        return tmp_path

    yield make
    for mod in modules:  # the next test may reuse a module name with other contents
        sys.modules.pop(mod, None)


def minisgl_cmd() -> list[str]:
    script = Path(sys.executable).with_name("minisgl")
    if script.exists():
        return [str(script)]
    found = shutil.which("minisgl")
    return [found] if found else [sys.executable, "-m", "minisgl.server.cli"]


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def broken(fake_dist: FakeDist) -> Path:
    return fake_dist("fake-broken", {"broken": "fake_broken_plugin"},
                     {"fake_broken_plugin": "raise ImportError('fixture: deliberately broken')\n"})


# -- discovery and listing ----------------------------------------------------------------------


def test_builtins_and_fixture_register_through_entry_points() -> None:
    pm = get_plugin_manager()
    assert "fixture" in pm.plugins, "pip install --no-deps tests/plugins/minisgl-fixture-plugin"
    for ep, package in {**BUILTIN, "fixture": FIXTURE_PKG}.items():
        info = pm.plugins[ep]
        assert info.package == package and info.version == "0.1.0"
    assert pm.plugins["models"].registers["models"] == [
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    assert pm.plugins["backends"].registers == {"attention_backends": ["torch"]}
    assert pm.plugins["core"].registers == {"samplers": ["default"], "schedulers": ["fcfs", "lpm"]}
    assert pm.plugins["fixture"].registers == {"models": ["FixtureLlamaForCausalLM"],
                                               "samplers": ["fixture-lowest"]}
    owner = {e.name: (e.plugin, e.package) for e in pm.models.entries()}
    assert owner["FixtureLlamaForCausalLM"] == ("fixture", FIXTURE_PKG)
    assert owner["LlamaForCausalLM"] == ("models", "minisgl-models")
    assert pm.failed == []


def test_cli_lists_plugins_and_json_parses() -> None:
    text = run([*minisgl_cmd(), "plugins"])
    assert text.returncode == 0, text.stderr
    for ep, package in {**BUILTIN, "fixture": FIXTURE_PKG}.items():
        assert f"{ep}  ({package} 0.1.0," in text.stdout
    for name in ("LlamaForCausalLM", "FixtureLlamaForCausalLM", "torch", "fcfs", "fixture-lowest"):
        assert name in text.stdout
    js = run([*minisgl_cmd(), "plugins", "--json"])
    data = json.loads(js.stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["fixture"]["package"] == FIXTURE_PKG
    assert by_name["fixture"]["registers"]["samplers"] == ["fixture-lowest"]
    assert by_name["backends"]["registers"]["attention_backends"] == ["torch"]
    assert data["failed"] == []


# -- one manager per process, lazy registration --------------------------------------------------


COUNTER_SRC = f"""
import os
{HOOK}
def _log(what):
    with open(os.environ["COUNTER_FILE"], "a") as f:
        f.write(what + "\\n")

_log("import")

@hookimpl
def minisgl_register_models(registry):
    _log("register")
"""


def test_one_manager_per_process_loaded_once(fake_dist: FakeDist, tmp_path: Path) -> None:
    assert get_plugin_manager() is get_plugin_manager()
    path = fake_dist("fake-counter", {"counter": "fake_counter_plugin"},
                     {"fake_counter_plugin": COUNTER_SRC})
    counter = tmp_path / "count.txt"
    code = ("from minisgl.core.plugins import get_plugin_manager as g\n"
            "assert g() is g() is g()\nprint(sorted(g().plugins))")
    out = run([sys.executable, "-c", code], PYTHONPATH=str(path), COUNTER_FILE=str(counter))
    assert out.returncode == 0, out.stderr
    assert "counter" in out.stdout
    assert counter.read_text().split() == ["import", "register"]


def test_registration_is_lazy() -> None:
    code = textwrap.dedent("""
        import json, sys
        from minisgl.core.plugins import get_plugin_manager
        pm = get_plugin_manager()
        mods = ["minisgl.models.llama", "minisgl.backends.torch_native",
                "minisgl_fixture_plugin.model", "minisgl_fixture_plugin.sampler"]
        before = [m for m in mods if m in sys.modules]
        pm.models.get("LlamaForCausalLM")
        print(json.dumps([before, "minisgl.models.llama" in sys.modules]))
    """)
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [[], True]


# -- the fixture plugin's model and sampler actually run ------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random 2-layer Llama saved twice: as LlamaForCausalLM and as FixtureLlamaForCausalLM."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.1,
                      tie_word_embeddings=False)
    base = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(base)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(base)
    dirs = {}
    for arch in ("LlamaForCausalLM", "FixtureLlamaForCausalLM"):
        dirs[arch] = d = tmp_path_factory.mktemp(arch)
        copy_checkpoint(base, d, arch)
    return dirs


def copy_checkpoint(src: Path, dst: Path, arch: str) -> None:
    """Copy an HF directory, naming another architecture in its config.json."""
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    conf = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**conf, "architectures": [arch]}))


PROMPTS = [[5, 9, 17, 33, 4], [100, 7, 7, 42]]


def llm(path: Path, **kw: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_pages=32, **kw)


@pytest.fixture(scope="module")
def hf_next_logits(tiny_llama: dict[str, Path]) -> Callable[[list[int]], torch.Tensor]:
    """The independent reference: HF transformers' float64 logits of the next token."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama["LlamaForCausalLM"],
                                             dtype=torch.float32).eval()

    def next_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].double()

    return next_logits


def test_fixture_model_runs_like_llama(tiny_llama: dict[str, Path],
                                       hf_next_logits: Callable[[list[int]], torch.Tensor]
                                       ) -> None:
    from minisgl_fixture_plugin.model import FixtureLlamaForCausalLM

    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fixture = llm(tiny_llama["FixtureLlamaForCausalLM"])
    assert type(fixture.engine.model) is FixtureLlamaForCausalLM
    got = [o.token_ids for o in fixture.generate(PROMPTS, sp)]
    want = [o.token_ids for o in llm(tiny_llama["LlamaForCausalLM"]).generate(PROMPTS, sp)]
    assert got == want and all(len(t) == 6 for t in got)
    for prompt, tokens in zip(PROMPTS, got):  # and both are right: each token is HF's argmax
        assert tokens == [int(hf_next_logits(prompt + tokens[:i]).argmax()) for i in range(6)]


def test_fixture_sampler_rule(tiny_llama: dict[str, Path],
                              hf_next_logits: Callable[[list[int]], torch.Tensor]) -> None:
    engine = llm(tiny_llama["LlamaForCausalLM"], sampler="fixture-lowest")
    assert type(engine.engine.sampler).__module__ == "minisgl_fixture_plugin.sampler"
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    not_argmax = 0
    for prompt, out in zip(PROMPTS, outs):
        for i, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
            logits = hf_next_logits(prompt + out.token_ids[:i]).tolist()
            top2 = sorted(range(len(logits)), key=lambda t: -logits[t])[:2]
            assert token == min(top2)
            assert logprob == pytest.approx(logits[token] - math.log(sum(map(math.exp, logits))),
                                            abs=1e-4)
            not_argmax += token != top2[0]
    assert not_argmax > 0, "the rule never differed from greedy: the test could not tell them apart"


# -- failures, duplicates, unknown names ---------------------------------------------------------


def test_broken_plugin_is_reported_and_skipped(fake_dist: FakeDist) -> None:
    broken(fake_dist)
    with pytest.warns(RuntimeWarning) as rec:
        pm = PluginManager(strict=False)
    msg = str(rec[0].message)
    for part in ("'broken'", "fake-broken", "fake_broken_plugin", "ImportError",
                 "deliberately broken"):
        assert part in msg
    [failed] = pm.failed
    assert (failed.name, failed.package, failed.value) == ("broken", "fake-broken",
                                                           "fake_broken_plugin")
    assert failed.error == "ImportError: fixture: deliberately broken"
    assert "broken" not in pm.plugins
    assert {*BUILTIN, "fixture"} <= set(pm.plugins)
    assert "LlamaForCausalLM" in pm.models and "torch" in pm.attention_backends
    assert "FAILED: ImportError: fixture: deliberately broken" in pm.describe()


def test_broken_plugin_raises_under_strict(fake_dist: FakeDist,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    broken(fake_dist)
    with pytest.raises(PluginError, match=r"'broken' from package fake-broken .*ImportError"):
        PluginManager(strict=True)
    monkeypatch.setenv("MINISGL_STRICT_PLUGINS", "1")  # strict=None reads the environment
    with pytest.raises(PluginError, match="deliberately broken"):
        PluginManager()
    monkeypatch.setenv("MINISGL_STRICT_PLUGINS", "0")
    with pytest.warns(RuntimeWarning, match="fake-broken"):
        assert [f.name for f in PluginManager().failed] == ["broken"]


def test_cli_shows_failed_plugin(fake_dist: FakeDist) -> None:
    path = broken(fake_dist)
    out = run([*minisgl_cmd(), "plugins"], PYTHONPATH=str(path), MINISGL_STRICT_PLUGINS="0")
    assert out.returncode == 0, out.stderr
    assert ("broken  (fake-broken, fake_broken_plugin)  FAILED: ImportError: fixture: "
            "deliberately broken") in out.stdout
    assert "models  (minisgl-models 0.1.0" in out.stdout  # the others still load
    js = run([*minisgl_cmd(), "plugins", "--json"], PYTHONPATH=str(path),
             MINISGL_STRICT_PLUGINS="0")
    assert json.loads(js.stdout)["failed"] == [{
        "name": "broken", "package": "fake-broken", "value": "fake_broken_plugin",
        "error": "ImportError: fixture: deliberately broken"}]


def test_duplicate_registration_names_both_packages(fake_dist: FakeDist) -> None:
    fake_dist("fake-dup", {"dup": "fake_dup_plugin"}, {"fake_dup_plugin": HOOK + """
@hookimpl
def minisgl_register_models(registry):
    registry.register("LlamaForCausalLM", "fake_dup_plugin:Nothing")
"""})
    with pytest.raises(PluginError, match="'LlamaForCausalLM' is registered twice") as exc:
        PluginManager(strict=False)
    assert "fake-dup" in str(exc.value) and "minisgl-models" in str(exc.value)


def test_duplicate_entry_point_name_names_both_packages(fake_dist: FakeDist) -> None:
    fake_dist("fake-models", {"models": "fake_models_plugin"}, {"fake_models_plugin": ""})
    with pytest.raises(PluginError, match="entry point name 'models'") as exc:
        PluginManager(strict=False)
    assert "fake-models" in str(exc.value) and "minisgl-models" in str(exc.value)


def test_misspelled_hook_fails_loudly(fake_dist: FakeDist) -> None:
    fake_dist("fake-typo", {"typo": "fake_typo_plugin"}, {"fake_typo_plugin": HOOK + """
@hookimpl
def minisgl_register_modles(registry):
    pass
"""})
    with pytest.raises(pluggy.PluginValidationError, match="minisgl_register_modles"):
        PluginManager(strict=False)


def test_invalid_hookimpl_is_skipped_whole(fake_dist: FakeDist) -> None:
    """A hookimpl with a wrong signature fails the plugin; its valid hooks must not leak in."""
    fake_dist("fake-badsig", {"badsig": "fake_badsig_plugin"}, {"fake_badsig_plugin": HOOK + """
@hookimpl
def minisgl_register_attention_backends(registry):
    registry.register("leaked", "nowhere:Nothing")

@hookimpl
def minisgl_register_models(reg):
    pass
"""})
    with pytest.warns(RuntimeWarning, match="fake-badsig"):
        pm = PluginManager(strict=False)
    assert [(f.name, f.package) for f in pm.failed] == [("badsig", "fake-badsig")]
    assert "PluginValidationError" in pm.failed[0].error
    assert "leaked" not in pm.attention_backends
    with pytest.raises(PluginError, match="fake-badsig"):
        PluginManager(strict=True)


@pytest.mark.parametrize("kind,known", [("models", "LlamaForCausalLM"),
                                        ("attention_backends", "torch"),
                                        ("samplers", "fixture-lowest"), ("schedulers", "fcfs")])
def test_unknown_name_lists_registered(kind: str, known: str) -> None:
    registry = get_plugin_manager().registries[kind]
    with pytest.raises(UnknownNameError, match=f"unknown .*'nope'; registered: .*{known}"):
        registry.get("nope")
    with pytest.raises(LookupError):
        registry.get("nope")


def test_unknown_names_through_llm(tiny_llama: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(UnknownNameError, match=r"attention backend 'nope'; registered: .*torch"):
        llm(tiny_llama["LlamaForCausalLM"], attention_backend="nope")
    copy_checkpoint(tiny_llama["LlamaForCausalLM"], tmp_path, "NopeForLM")
    with pytest.raises(UnknownNameError, match="'NopeForLM'; registered: .*LlamaForCausalLM"):
        llm(tmp_path)


# -- registry semantics, env vars, the other two hooks -------------------------------------------


def test_registry_is_lazy_and_rejects_duplicates() -> None:
    reg = Registry("widget")
    reg.register("later", "no_such_module_anywhere:Thing")  # nothing imported yet
    reg.register("nested", "minisgl.core.registry:Registry.register")
    reg.register("object", len)
    assert reg.get("nested") is Registry.register and reg.get("object") is len
    with pytest.raises(ModuleNotFoundError):
        reg.get("later")
    with pytest.raises(PluginError, match="widget 'object' is registered twice"):
        reg.register("object", max)
    assert reg.names() == ["later", "nested", "object"]


def test_allow_and_deny_env(fake_dist: FakeDist, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINISGL_PLUGINS_ALLOW", "core, models")
    pm = PluginManager(strict=True)
    assert set(pm.plugins) == {"core", "models"}
    with pytest.raises(UnknownNameError, match="registered: none"):
        pm.attention_backends.get("torch")
    monkeypatch.delenv("MINISGL_PLUGINS_ALLOW")
    monkeypatch.setenv("MINISGL_PLUGINS_DENY", "fixture")
    pm = PluginManager(strict=True)
    assert "fixture" not in pm.plugins and "FixtureLlamaForCausalLM" not in pm.models
    assert {*BUILTIN} <= set(pm.plugins)
    broken(fake_dist)  # denying a broken plugin is the way around it, even under strict
    monkeypatch.setenv("MINISGL_PLUGINS_DENY", "broken,fixture")
    assert "broken" not in PluginManager(strict=True).plugins


EXTRA_SRC = HOOK + """
from minisgl.core.policy import SchedulePolicy

class NewestFirst(SchedulePolicy):
    def order(self, waiting, cache):
        return sorted(waiting, key=lambda r: -r.rid)

@hookimpl
def minisgl_register_attention_backends(registry):
    registry.register("fake-sdpa", "minisgl.backends.torch_native:TorchNativeBackend")

@hookimpl
def minisgl_register_schedulers(registry):
    registry.register("fake-newest", NewestFirst)

@hookimpl
def minisgl_register_samplers(registry):
    registry.register("fake-default", "minisgl.core.sampling:TorchSampler")

@hookimpl
def minisgl_register_models(registry):
    registry.register("FakeLlama", "minisgl.models.llama:LlamaForCausalLM")
"""


def test_third_party_plugin_implementing_every_hook(fake_dist: FakeDist, tmp_path: Path,
                                                    tiny_llama: dict[str, Path]) -> None:
    from minisgl.backends.torch_native import TorchNativeBackend
    from minisgl.core.config import EngineConfig
    from minisgl.core.engine import Engine
    from minisgl.core.request import Req
    from minisgl.core.sampling import TorchSampler
    from minisgl.models.llama import LlamaForCausalLM

    fake_dist("fake-extra", {"extra": "fake_extra_plugin"}, {"fake_extra_plugin": EXTRA_SRC})
    pm = PluginManager(strict=True)
    assert pm.plugins["extra"].registers == {
        "attention_backends": ["fake-sdpa"], "schedulers": ["fake-newest"],
        "samplers": ["fake-default"], "models": ["FakeLlama"]}
    copy_checkpoint(tiny_llama["LlamaForCausalLM"], tmp_path, "FakeLlama")
    config = EngineConfig(model=str(tmp_path), dtype="float32", num_pages=8,
                          attention_backend="fake-sdpa", sampler="fake-default")
    engine = Engine(config, plugins=pm)
    assert type(engine.model) is LlamaForCausalLM
    assert type(engine.backend) is TorchNativeBackend
    assert type(engine.sampler) is TorchSampler
    policy = pm.schedulers.get("fake-newest")(config)
    reqs = [Req([3], SamplingParams()) for _ in range(3)]
    assert policy.order(reqs, None) == reqs[::-1]


def test_every_hookspec_is_tested() -> None:
    """A new hook must come with a test here (datasette style) and be collected by the manager."""
    specs = {n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "minisgl_spec")}
    assert specs, "no hookspecs found"
    assert specs == {hook for _, hook in KINDS.values()}
    text = Path(__file__).read_text()
    for name in specs:
        # mentioned in an @hookimpl of some plugin source above, not just in this test
        assert f"def {name}(registry" in text, f"hook {name} has no test in {__file__}"
