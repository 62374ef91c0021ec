"""How long a LocalCluster takes to be ready to build engines: workers spawned against workers forked
from a server that has imported torch, transformers and vLLM once (``cluster.connect(worker_start=...)``).

    python bench/worker_start.py [--repeats 2]

Each side runs in its own process (a forkserver lives as long as the process that started it): per
repeat, ``cluster.connect`` of one rollout and two trainer workers, then every worker imports what an
engine and a trainer rank need (vLLM, transformers, the kit's worker modules). Ends with ONE JSON line:
per side the seconds of each repeat (connect, imports) and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _imports() -> bool:
    import transformers  # noqa: F401
    import vllm  # noqa: F401

    import grpo_kit.remote  # noqa: F401
    import grpo_kit.train_step  # noqa: F401
    import grpo_kit.vllm_engine  # noqa: F401

    return True


def side(method: str, repeats: int) -> list[dict]:
    from grpo_kit import cluster as cl

    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client = cl.connect(n_rollout_workers=1, n_trainer_workers=2, worker_start=method, quiet=True)
        t1 = time.perf_counter()
        assert all(client.run(_imports).values())
        t2 = time.perf_counter()
        cl.shutdown(client)
        out.append({"connect_s": round(t1 - t0, 2), "imports_s": round(t2 - t1, 2), "ready_s": round(t2 - t0, 2)})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--side", choices=("spawn", "forkserver"), help=argparse.SUPPRESS)  # a child's one side
    args = ap.parse_args(argv)
    if args.side:
        print(json.dumps(side(args.side, args.repeats)))
        return {}
    figures: dict = {"load_average_start": os.getloadavg()[0]}
    # an untimed import pass first, so that neither side reads the packages from a colder page cache
    subprocess.run([sys.executable, "-c", "import torch, transformers, vllm"], capture_output=True, check=False)
    for method in ("spawn", "forkserver"):
        run = subprocess.run([sys.executable, __file__, "--side", method, "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        figures[method] = json.loads(run.stdout.strip().splitlines()[-1])
        print(method, figures[method], flush=True)
    figures["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
