#!/usr/bin/env bash
# A short GPU check for a lent device machine (one GPU, a few minutes). Run from the repo root:
#   bash bench/gpu_check.sh
# That machine has python3 with torch, transformers, peft, safetensors, tokenizers and pytest, but
# no vLLM and no network, so this check uses the HF engine. Carry wheels for what it lacks (dask,
# distributed, plotly, datasets and their needs) in .whl/ and the tiny model in .tiny/:
#   here: pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ... -d .whl \
#         dask distributed tblib zict locket tornado partd setproctitle importlib_metadata lazy-importer dill \
#         cloudpickle msgpack sortedcontainers toolz click psutil pyyaml fsspec plotly narwhals
#         (the last line: what dask, distributed and grpo_kit.loop import that the image may lack; psutil,
#         msgpack and pyyaml are compiled: download them for the image's Python)
#         cp -r ~/.cache/grpo_kit/tiny-* .tiny/
# It prints: the CUDA test subset (NCCL world-size-1 DDP step, bf16 loss path, HF engine on CUDA),
# then the tiny profile's pipelined loop on CUDA for a few iterations with its figures.
set -euo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -d .tiny ]; then export GRPO_KIT_CACHE=$PWD/.tiny; fi
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
# the loop starts worker processes (spawn), which re-import the main module: it must be a file
cat > /tmp/gpu_check_loop.py <<'PY'
import json, time
from grpo_kit import config, loop
if __name__ == "__main__":
    cfg = config.profile("tiny", engine="hf", iterations=6, eval_every=3, eval_size=64, run_dir="/tmp/gpu-check-run")
    from grpo_kit import cluster
    client = cluster.connect(n_rollout_workers=cfg.cluster.n_rollout_workers, n_trainer_workers=cfg.cluster.world_size, quiet=True)
    def device_of(dask_worker=None):  # where the workers put models: what the loop below ran on
        import os, torch
        return {"cuda": torch.cuda.is_available(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    print("workers:", client.run(device_of))
    t0 = time.time()
    res = loop.run(cfg, client=client, progress=False)
    cluster.shutdown(client)
    for r in res.records:
        print({k: r.get(k) for k in ("iteration", "reward_mean", "ratio_mean", "clip_frac", "kl_mean", "gen_s", "train_s", "iter_s", "eval_acc")})
    print(json.dumps({**res.summary, "wall_s": time.time() - t0}))
PY
python3 /tmp/gpu_check_loop.py
# TRL with vLLM beside the kit and TRL's default (issue 27): only where this machine has vLLM and TRL
# (the machine lent so far had neither, and no network to install them); the tiny profile, whose
# model travels in .tiny/ (SmolLM2's wheel is over the carry limit)
if python3 -c "import vllm, trl" 2>/dev/null; then
  python3 bench/vs_trl.py --repeats 1 --sides kit,trl,trl_vllm --no-progress --out /tmp/gpu-check-vs-trl
else
  echo "gpu_check: no vllm or trl on this machine: bench/vs_trl.py's TRL-vLLM side not run"
fi
