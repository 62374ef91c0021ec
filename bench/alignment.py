"""On-policy alignment of each rollout engine with the trainer's log-probs.

    python bench/alignment.py [--model tiny|smollm2-135m|DIR] [--problems 32] [--group-size 6] [--max-new-tokens 48]
                              [--temperature 1.0] [--multi-turn [--max-turns 3] [--min-tokens 2000]]

For each engine (vLLM with the adapter merged into its weights, vLLM with a per-request LoRA, HF)
on the model (default the tiny one; ``smollm2-135m`` is a real chat model, prompted through its chat
template) with a non-trivial LoRA adapter (random B matrices,
published to an AdapterStore as version 1): sample completions, recompute the log-probs of the
same token ids with ``logprobs.token_logprobs`` under the same adapter (loaded from the store the
way the trainer loads it), and report the on-policy importance ratio ``exp(logp - old_logp)``:
its mean (should be 1), std and the largest |delta logp|. At ``--temperature`` the engines sample
and record the tempered distribution, and the trainer scores the same one. The last line is JSON.

``--multi-turn``: the same check over multi-turn episodes (:class:`grpo_kit.episode.EpisodeRunner`,
each engine's ``sample_ids``): the :class:`~grpo_kit.testing.Notes` environment with the scripted
:class:`~grpo_kit.testing.CallEveryTurn` parser (neither model calls tools by itself), so every turn
before ``--max-turns`` is followed by an environment segment; turns are cut at ``--max-new-tokens``
(a turn cut there ends its episode) and, for a chat model, at the stop string ``.``. Rounds of
``--problems`` x ``--group-size`` episodes are played (a new iteration's seeds each) until the
episodes hold ``--min-tokens`` model (mask-1) tokens; the trainer then scores each episode's whole
stream (prompt, model and environment ids, one teacher-forced forward per batch, as it trains) and
the comparison covers the mask-1 tokens only. Its JSON keys are the single-turn ones with a
``multiturn_`` prefix, plus the episodes' count, their mean turns and the share with >= 2 turns.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from grpo_kit import data, models
from grpo_kit.adapters import AdapterStore
from grpo_kit.hf_engine import HFEngine
from grpo_kit.prompts import PromptFormat
from grpo_kit.testing import dlogp, perturbed_adapter, policy, ratio_stats

CHAT_TURN_STOP = (".",)
"""Stop strings of a chat model's turns in ``--multi-turn`` (short turns: a sentence, or the end-of-turn token)."""
SCORE_BATCH = 8
"""Episodes per teacher-forced forward (SmolLM2's 49k-word logits over whole streams add up)."""


def play_episodes(engine, problems, group_size: int, version: int, *, max_turns: int, turn_tokens: int,
                  temperature: float, min_tokens: int, max_rounds: int = 50):
    """Multi-turn episodes on ``engine`` (module docstring) until they hold ``min_tokens`` model tokens."""
    from grpo_kit.config import EpisodeConfig
    from grpo_kit.episode import EpisodeRunner
    from grpo_kit.renderers import ChatRenderer, for_engine
    from grpo_kit.testing import CallEveryTurn, Notes

    renderer = for_engine(engine)
    if isinstance(renderer, ChatRenderer):
        renderer = ChatRenderer(engine.tokenizer, stop=CHAT_TURN_STOP)
    cfg = EpisodeConfig(max_turns=max_turns, max_turn_tokens=turn_tokens,
                        max_episode_tokens=engine.max_model_len // 2)
    runner = EpisodeRunner(engine, renderer, environment_factory=Notes, tool_parser=CallEveryTurn(), cfg=cfg,
                           prompt_format=engine.prompt_format, temperature=temperature)
    episodes = []
    for it in range(max_rounds):
        episodes += runner.run(problems, group_size, version, seed=0, iteration=it)
        if sum(e.sampled_tokens for e in episodes) >= min_tokens:
            break
    return episodes


def episode_stats(scorer, episodes, temperature: float) -> dict:
    """:func:`grpo_kit.testing.ratio_stats` over the episodes' mask-1 tokens (the whole streams scored),
    plus the episodes' count, mean turns and the share with at least two turns."""
    import torch

    from grpo_kit.episode import to_rollout

    rollouts = [to_rollout(e) for e in episodes]
    d = torch.cat([dlogp(scorer, rollouts[i:i + SCORE_BATCH], temperature=temperature)
                   for i in range(0, len(rollouts), SCORE_BATCH)])
    return {**ratio_stats(d, rollouts), "episodes": len(episodes),
            "turns_mean": sum(e.turns for e in episodes) / len(episodes),
            "multi_turn_share": sum(e.turns >= 2 for e in episodes) / len(episodes),
            "env_tokens": sum(len(e.completion_ids) - e.sampled_tokens for e in episodes)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2-135m or a checkpoint directory")
    ap.add_argument("--lora-scale", type=float, default=None, help="std of the random B matrices "
                    "(default 0.05 for tiny, 0.01 otherwise)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (scored tempered)")
    ap.add_argument("--version", type=int, default=1, help="1: the perturbed adapter; 0: the base model")
    ap.add_argument("--engines", nargs="+", default=["vllm_merged", "vllm_request", "hf"],
                    choices=["vllm_merged", "vllm_request", "hf"])
    ap.add_argument("--multi-turn", action="store_true", help="multi-turn episodes (module docstring)")
    ap.add_argument("--max-turns", type=int, default=3, help="--multi-turn: model turns per episode at most")
    ap.add_argument("--min-tokens", type=int, default=2000, help="--multi-turn: model tokens to compare at least")
    args = ap.parse_args(argv)

    path = models.resolve_model(args.model)
    scale = args.lora_scale if args.lora_scale is not None else (0.05 if args.model == "tiny" else 0.01)
    store = AdapterStore(tempfile.mkdtemp(prefix="bench-alignment-"))
    store.publish(perturbed_adapter(path, seed=1, scale=scale), 1)
    problems = data.synthetic_problems(args.problems, split="train", seed=0, n_digits=3 if args.model == "tiny" else 2)
    kw = {"max_new_tokens": args.max_new_tokens, "seed": 0, "temperature": args.temperature}
    common = {"store": store, "prompt_format": PromptFormat(), "max_model_len": 512 if args.multi_turn else 256}

    def vllm(**kw):
        from grpo_kit.vllm_engine import VLLMEngine

        return VLLMEngine(path, **kw, **common)

    results = {}
    engines = {
        "vllm_merged": lambda: vllm(lora_mode="merged"),
        "vllm_request": lambda: vllm(max_lora_rank=8, lora_mode="request"),
        "hf": lambda: HFEngine(path, **common),
    }
    scorer = policy(path, store, args.version)
    for name, build in engines.items():
        if name not in args.engines:
            continue
        t0 = time.perf_counter()
        engine = build()
        if args.multi_turn:
            episodes = play_episodes(engine, problems, args.group_size, args.version, max_turns=args.max_turns,
                                     turn_tokens=args.max_new_tokens, temperature=args.temperature,
                                     min_tokens=args.min_tokens)
            engine.close()
            st = episode_stats(scorer, episodes, args.temperature)
        else:
            rollouts = engine.generate(problems, args.group_size, args.version, **kw)
            engine.close()
            st = ratio_stats(dlogp(scorer, rollouts, temperature=args.temperature), rollouts)
        results[name] = st
        what = (f"{st['tokens']} model tokens of {st['episodes']} episodes ({st['turns_mean']:.2f} turns, "
                f"{st['multi_turn_share']:.0%} with >= 2; {st['env_tokens']} environment tokens; {st['truncated']} "
                f"out of budget)" if args.multi_turn else f"{st['tokens']} completion tokens ({st['truncated']} truncated)")
        print(
            f"{name:12s} v{args.version}: {what}, "
            f"ratio mean {st['ratio_mean']:.8f} std {st['ratio_std']:.2e}, max |dlogp| {st['max_abs_dlogp']:.2e} "
            f"({time.perf_counter() - t0:.1f}s)",
            flush=True,
        )
    prefix = "multiturn_" if args.multi_turn else ""
    print(
        json.dumps(
            {
                "model": args.model,
                "version": args.version,
                "temperature": args.temperature,
                **({"multi_turn": True, "max_turns": args.max_turns} if args.multi_turn else {}),
                **{f"{prefix}{e}_{k}": v for e, st in results.items() for k, v in st.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
