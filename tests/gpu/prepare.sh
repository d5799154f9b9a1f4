#!/usr/bin/env bash
# Run HERE (the development machine) right before tests/gpu/run.sh goes to a GPU machine: builds
# wheels of the four minisgl packages and of the server's dependencies the GPU image lacks (the
# versions installed here) into .whl/, and copies the bundled SmolLM2's config and tokenizer
# (not its weights: 538 MB is over what travels; run.sh draws random weights of the same shape)
# into .gpu/. Both folders are git-ignored (.git/info/exclude) and travel with
# `carry: [".whl", ".gpu"]`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .whl .gpu && mkdir -p .whl .gpu/smollm2
"$PY" -m pip wheel -q --no-deps -w .whl ./minisgl-core ./minisgl-models ./minisgl-backends ./minisgl-server
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
  $("$PY" -c "from importlib.metadata import version as v
print(*(f'{n}=={v(n)}' for n in ('msgspec', 'pyzmq', 'starlette', 'uvicorn', 'httptools')))")
src=$("$PY" -c "from minisgl.core.bundled import resolve_model; print(resolve_model('smollm2'))")
cp "$src"/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/smollm2/
du -sh .whl .gpu
