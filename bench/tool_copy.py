"""Does the tiny-tools model copy the tool's result? The probe behind issue 24's 82% plateau.

    python bench/tool_copy.py [--model tiny-tools] [--run-dir DIR --version V] [--n 30]

For held-out calculator questions whose true product has 4 and 5 digits, the stream the episode runner
plays after a right call (the plain prompt with the ``multiply`` tool's line, ``<call>multiply(a, b)</call>``,
then ``"\\nResult: <R>\\n"``, each segment tokenized on its own) is given to the model, with ``R`` the
true product or a random 4- or 5-digit number, and its greedy answer is read. A model that copies
writes ``#### R`` whatever ``R`` is; one that computes (or recalls) writes the product. The base
model, or an adapter ``--version`` of a run in ``--run-dir`` (the tiny-tools profile's store), is
probed. Greedy decoding in this process (transformers, one torch thread), about a minute on 2 cores.

Ends with ONE JSON line: per case ``q<digits of the product>_<result>`` (``true``, ``rand4``,
``rand5``), the share of answers that are ``#### R`` exactly (``copied``) and that are the true
product (``product``), and ``n`` per case.
"""

from __future__ import annotations

import argparse
import json
import random

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_kit import config, models, tasks
from grpo_kit.prompts import prompt_format
from grpo_kit.renderers import PLAIN_RESULT, PlainRenderer
from grpo_kit.tools import ToolBox


def greedy(model, ids: list[int], eos: int, max_new_tokens: int = 8) -> list[int]:
    """Greedy continuation of ``ids`` (no cache: a few tokens on a 4-layer model)."""
    out: list[int] = []
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            t = int(model(input_ids=x).logits[0, -1].argmax())
            if t == eos:
                break
            out.append(t)
            x = torch.cat([x, torch.tensor([[t]])], 1)
    return out


def probe(model, tok, n: int, seed: int = 0) -> dict:
    cfg = config.profile("tiny-tools")
    task = tasks.for_config(cfg)
    fmt, box, renderer = prompt_format(cfg, task.instruction), ToolBox(list(task.tools)), PlainRenderer(tok)
    rng = random.Random(seed)
    pool = task.load("heldout", 256, 0)
    figures: dict = {}
    for digits in (4, 5):
        probs = [p for p in pool if len(p.gold) == digits][:n]
        for case in ("true", "rand4", "rand5"):
            copied = product = 0
            for p in probs:
                result = (
                    p.gold if case == "true" else str(rng.randrange(10 ** (int(case[-1]) - 1), 10 ** int(case[-1])))
                )
                ids = (
                    renderer.encode(renderer.prompt(fmt.messages(p.question), box.schemas()))
                    + renderer.encode(f"<call>multiply({p.columns['a']}, {p.columns['b']})</call>")
                    + renderer.encode(PLAIN_RESULT.format(content=result))
                )
                answer = tok.decode(greedy(model, ids, tok.eos_token_id)).strip()
                copied += answer == f"#### {result}"
                product += answer == f"#### {p.gold}"
            key = f"q{digits}_{case}"
            figures[f"{key}_copied"] = copied / len(probs) if probs else None
            figures[f"{key}_product"] = product / len(probs) if probs else None
            figures[f"{key}_n"] = len(probs)
            print(
                f"product of {digits} digits, result {case:5}: copied {copied}/{len(probs)}, wrote the product "
                f"{product}/{len(probs)}",
                flush=True,
            )
    return figures


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-tools", help="model name or directory (default: tiny-tools)")
    ap.add_argument("--run-dir", help="a tiny-tools run whose adapter --version to probe")
    ap.add_argument("--version", type=int, default=0, help="adapter version in the run's store (0: the base model)")
    ap.add_argument("--n", type=int, default=30, help="questions per product length (default 30)")
    args = ap.parse_args(argv)
    if args.version and not args.run_dir:
        ap.error("--version needs --run-dir")
    torch.set_num_threads(1)
    path = models.resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if args.version:
        from peft import PeftModel

        from grpo_kit.adapters import AdapterStore

        store = AdapterStore(config.profile("tiny-tools", run_dir=args.run_dir).run.store_root)
        model = PeftModel.from_pretrained(model, store.fetch(args.version)).eval()
    figures = {"model": args.model, "version": args.version, **probe(model, tok, args.n)}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
