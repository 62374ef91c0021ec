"""Helpers shared by the tests and the benches: an adapter that really changes a model, the policy
of a stored version as the trainer builds it, and the engine/trainer log-prob alignment check.

Alignment: an engine records the sampling log-prob of every token it samples; the trainer
recomputes the same tokens' log-probs with :func:`grpo_kit.logprobs.token_logprobs` under the
same adapter version. At temperature 1 they must agree (the on-policy importance ratio is 1), up to
float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The seven projections of Llama/Qwen blocks (the kit's default ``lora_targets``)."""


def perturbed_adapter(path, seed: int, scale: float = 0.05, r: int = 8, targets: Sequence[str] = LLAMA_TARGETS):
    """A PEFT LoRA on the model at ``path`` whose B matrices are random (the default B = 0 would
    change nothing), so each seed is a clearly different policy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, scale)
    return model.eval()


def policy(path, store, version: int):
    """The policy of ``version`` as the trainer builds it: the base model plus the store's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return base if version == 0 else PeftModel.from_pretrained(base, store.fetch(version)).eval()


def dlogp(model, rollouts, temperature: float = 1.0) -> torch.Tensor:
    """(N,) float64: the trainer's recomputed log-prob minus the sampling log-prob, over all
    completion tokens of ``rollouts`` the policy sampled (``mask`` 1; ``temperature`` scores the tempered
    distribution)."""
    from .logprobs import token_logprobs
    from .train_step import collate

    batch = collate([(r.prompt_ids, r.completion_ids, r.logprobs, 0.0, r.mask) for r in rollouts], pad_id=0)
    with torch.no_grad():
        logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.completion_mask,
                              temperature=temperature)
    m = batch.completion_mask.bool()
    return (logp[m] - batch.old_logp[m]).double()


def ratio_stats(d: torch.Tensor, rollouts=()) -> dict[str, float]:
    """Summary of :func:`dlogp`'s output: the on-policy ratio's mean and std, the largest |delta|."""
    ratio = d.exp()
    return {
        "tokens": int(d.numel()),
        "ratio_mean": ratio.mean().item(),
        "ratio_std": ratio.std().item(),
        "max_abs_dlogp": d.abs().max().item(),
        "truncated": sum(r.truncated for r in rollouts),
    }


def assert_aligned(d: torch.Tensor, min_tokens: int = 512, max_abs: float = 1e-3, ratio_tol: float = 1e-4) -> None:
    """The engine's log-probs are the trainer's: max |delta logp| and the ratio mean's distance from 1."""
    assert d.numel() >= min_tokens, f"only {d.numel()} tokens compared (< {min_tokens})"
    assert d.abs().max().item() <= max_abs, f"max |dlogp| = {d.abs().max().item():.2e}"
    assert abs(d.exp().mean().item() - 1) <= ratio_tol, f"ratio mean - 1 = {d.exp().mean().item() - 1:.2e}"


def assert_run_exact(run_dir, cfg, store) -> None:
    """Nothing lost or repeated in a finished run: ``metrics.jsonl`` holds iterations 0..N-1 once
    each, ``rollouts.jsonl`` holds every group of every iteration exactly once (``group_size``
    samples each; groups ``0..prompts_per_step-1``, or with dynamic sampling every group its rounds
    generated), and the store holds versions 1..V, each the child of the one before (V = N, or with
    dynamic sampling the last record's version: an iteration with no usable group trains nothing)."""
    from collections import Counter

    from .records import read_jsonl, run_files

    files, n, s = run_files(run_dir), cfg.run.iterations, cfg.sampling
    recs = list(read_jsonl(files.metrics, stop_at_bad_line=True))
    its = [r["iteration"] for r in recs]
    assert its == list(range(n)), f"metrics.jsonl iterations {its}, want 0..{n - 1} once each"
    by_iter: dict[int, Counter] = {}
    for r in read_jsonl(files.rollouts, stop_at_bad_line=True):
        by_iter.setdefault(r["iteration"], Counter())[(r["group_id"], r["sample_idx"])] += 1
    assert sorted(by_iter) == list(range(n)), f"rollouts.jsonl iterations {sorted(by_iter)}"
    for it, counts in by_iter.items():
        groups = sorted({g for g, _ in counts}) if s.dynamic_sampling else range(s.prompts_per_step)
        want = {(g, i): 1 for g in groups for i in range(s.group_size)}
        assert dict(counts) == want, f"iteration {it}: groups lost or duplicated"
        if s.dynamic_sampling:
            assert len(groups) == recs[it]["generated_groups"], f"iteration {it}: {len(groups)} groups recorded"
    last = recs[-1]["version"] if s.dynamic_sampling else n
    vs = store.versions()
    assert vs == list(range(1, last + 1)), f"store versions {vs}, want 1..{last}"
    assert [store.manifest(v)["parent"] for v in vs] == list(range(last)), "adapter versions not a chain"


def hostile_programs(port: int, outside: str) -> dict[str, tuple[str, str]]:
    """Programs a code reward's sandbox must contain (``grpo_kit.sandbox``), for its tests and
    ``bench/rewards.py``: name -> (program, a word the failure reason must contain). ``port`` is a
    listening loopback port the program must not reach; ``outside`` a path it must not write."""
    return {
        "infinite loop": ("while True:\n    pass\n", "timed out"),
        "sleep": ("import time\ntime.sleep(1000)\n", "timed out"),
        "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "timed out"),
        "10 GB allocation": ("x = bytearray(10 * 1024**3)\n", "MemoryError"),
        "write outside": (f"open({str(outside)!r}, 'w').write('escaped')\n", "Error"),
        "loopback connection": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", "Error"),
        # The caller is never the program's parent (the launcher is, and in a PID namespace getppid() is 0).
        "kill the parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(0, signal.SIGKILL)\n"
                            "raise SystemExit('still here')\n", ""),
        "100 MB of output": ("import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)\n", "output over"),
        "exit(0) before the tests": ("import sys\nsys.exit(0)\nassert False\n", "exit(0)"),
        "os._exit(0) before the tests": ("import os\nos._exit(0)\nassert False\n", "before the end"),
        "setsid and sleep": ("import os, time\nos.setsid()\ntime.sleep(1000)\n", "timed out"),
    }


def hostile_completions() -> dict[str, tuple[int, str]]:
    """Completions that attack the code reward (``grpo_kit.tasks.code.code_reward``) instead of solving
    the problem, for its tests and ``bench/rewards.py``: name -> (HumanEval problem number, the
    completion: a body continuing the prompt, or whole functions). Every one must score 0. Problem 0
    (``has_close_elements``) expects True and False in turn; problem 4 (``mean_absolute_deviation``)
    is checked only through ``abs(candidate(...) - x) < 1e-6``."""
    main = "    import os, sys\n    m = sys.modules['__main__']\n"
    frame = ("    import json\n    def frame(msg):\n        b = json.dumps(msg).encode()\n"
             "        return len(b).to_bytes(4, 'big') + b\n")
    every_fd = ("    for fd in range(256):\n        try:\n            os.write(fd, data)\n"
                "        except OSError:\n            pass\n")
    return {
        # The launcher's nonce and result pipe as globals of the interpreter the candidate runs in.
        "nonce and pipe from __main__": (0, "    import sys, os; m = sys.modules['__main__']; "
                                            "os.write(m.w_fd, m.nonce.encode()); os._exit(0)\n"),
        # The same secret found through the stack instead of by name.
        "nonce from the caller's frames": (0, "    import os, sys\n    f = sys._getframe()\n"
                                              "    while f is not None and 'nonce' not in f.f_globals:\n"
                                              "        f = f.f_back\n"
                                              "    os.write(f.f_globals['w_fd'], f.f_globals['nonce'].encode())\n"
                                              "    os._exit(0)\n"),
        # Whatever the runner writes last becomes the secret.
        "os.write patched to write the nonce": (0, main + "    real = os.write\n"
                                                   "    os.write = lambda fd, b: real(fd, str(m.nonce).encode())\n"
                                                   "    raise AssertionError\n"),
        # No name needed: the secret (or anything) to every descriptor the process has, then a clean exit.
        "the nonce to every open descriptor": (0, main + "    data = str(getattr(m, 'nonce', '')).encode()\n"
                                                  + every_fd + "    os._exit(0)\n"),
        # Answers for the next calls written ahead, to every descriptor, all True.
        "answers written ahead to every descriptor": (0, main + frame + "    data = b''.join(frame(['ok', i, True])"
                                                         " for i in range(64))\n" + every_fd + "    return True\n"),
        # A child left behind writes after the candidate's process has gone.
        "a forked child writes later": (0, main + "    import time\n    if os.fork() == 0:\n"
                                           "        time.sleep(0.3)\n"
                                           "        data = str(getattr(m, 'nonce', '')).encode()\n"
                                           "        for fd in range(256):\n            try:\n"
                                           "                os.write(fd, data)\n            except OSError:\n"
                                           "                pass\n        os._exit(0)\n    os._exit(0)\n"),
        "sys.exit and atexit patched": (0, "    import atexit, os, sys\n    m = sys.modules['__main__']\n"
                                           "    atexit.register(lambda: os.write(m.w_fd, str(m.nonce).encode()))\n"
                                           "    sys.exit = lambda *a: None\n    raise SystemExit(0)\n"),
        # Objects whose comparisons always hold, returned for the tests to compare.
        "an object equal to anything": (0, "    class Any:\n        def __eq__(self, other):\n            return True\n"
                                           "        def __ne__(self, other):\n            return False\n"
                                           "        __hash__ = object.__hash__\n    return Any()\n"),
        "an int subclass equal to anything": (0, "    class B(int):\n        def __eq__(self, other):\n"
                                                 "            return True\n        __hash__ = int.__hash__\n"
                                                 "    return B(1)\n"),
        "a float subclass near anything": (4, "    class F(float):\n        def __sub__(self, other):\n"
                                              "            return 0.0\n    return F(0.0)\n"),
        # The tests' own abs (their tolerance check) rebound; the first call (before it) answered right.
        "builtins.abs rebound": (4, "    import builtins\n    builtins.abs = lambda x: 0\n    return 2.0 / 3.0\n"),
        # The prompt's helper that the tests use (HumanEval/32 checks ``poly(coeffs, solution)``) redefined.
        "the tests' helper redefined": (32, "```python\ndef poly(xs, x):\n    return 0.0\n\n\n"
                                            "def find_zero(xs):\n    return 0.0\n```\n"),
        # Every process it can signal, killed (the tests' process, if it could see it).
        "kill every process it can": (0, "    import os, signal\n    try:\n        os.kill(-1, signal.SIGKILL)\n"
                                         "    except OSError:\n        pass\n    return True\n"),
        # Hostile answers: over the size bound, nested past the depth bound, raw garbage.
        "an answer over the size bound": (0, "    return 'x' * (20 << 20)\n"),
        "an answer nested too deeply": (0, "    x = []\n    for _ in range(100000):\n        x = [x]\n    return x\n"),
        "garbage on the answer pipe": (0, main + "    data = b'\\xff' * 64\n" + every_fd + "    return True\n"),
    }


class CallEveryTurn:
    """A tool-call parser that reads one call to ``tool`` (with the turn's first characters as its
    ``text`` argument) in every turn: a model that never learned tools still plays multi-turn
    episodes, so the loop's multi-turn path is exercised on the tiny model."""

    def __init__(self, tool: str = "note") -> None:
        self.tool = tool

    def parse(self, text: str) -> list:
        from .tools import ToolCall

        return [ToolCall(self.tool, kwargs={"text": text[:12]})]


class Notes:
    """An environment written for TRL's ``environment_factory``: ``reset``, one public tool,
    ``get_reward`` (the number of notes taken)."""

    def reset(self, **kwargs) -> str | None:
        self.notes: list[str] = []
        return None

    def note(self, text: str) -> str:
        """Write a note down.

        Args:
            text: What to note.
        """
        self.notes.append(text)
        return f"noted {len(self.notes)}"

    def get_reward(self) -> float:
        return float(len(self.notes))


def notes_task(n_problems: int = 64):
    """A multi-turn task on the synthetic questions: :class:`Notes` as the environment,
    :class:`CallEveryTurn` as the parser, rewarded by the environment alone (:func:`env_reward`: the
    number of notes the episode took, one per tool call), correct from 2 notes on."""
    from . import data
    from .tasks import Task
    from .tasks.base import env_reward

    def problems(split, n, seed):
        return data.synthetic_problems(min(n, n_problems), split=split, seed=seed)

    return Task("notes", problems, [env_reward], environment_factory=Notes, tool_parser=CallEveryTurn(),
                correct_at=2.0)
