"""bench/vs_trl.py without running either trainer: arguments, prompt order, clocks and targets."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from grpo_kit import config, data, loop

BENCH = Path(__file__).resolve().parents[1] / "bench" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def test_defaults_come_from_the_tiny_profile(vs_trl):
    args = vs_trl.parse_args([])
    cfg = vs_trl.kit_config(args)
    tiny = config.profile("tiny")
    assert (cfg.run.iterations, cfg.run.eval_every) == (tiny.run.iterations, tiny.run.eval_every)
    assert (cfg.optim.lr, cfg.loss.kl_beta, cfg.sampling.group_size) == (tiny.optim.lr, tiny.loss.kl_beta, 6)
    assert cfg.sampling.prompts_per_step == 8
    assert cfg.sampling.engine == "vllm" and cfg.run.pipelined  # the kit's defaults
    assert cfg.run.run_dir.endswith("bench-vs-trl/kit")
    assert cfg.run.keep_versions == 0  # every checkpoint is evaluated from the store after the run
    assert vs_trl.dynamic_config(cfg, 3).run.keep_versions == 0


def test_quick_and_overrides(vs_trl):
    cfg = vs_trl.kit_config(vs_trl.parse_args(["--quick", "--lr", "1e-3", "--kl-beta", "0"]))
    assert cfg.run.iterations == vs_trl.QUICK["steps"]
    assert cfg.data.eval_size == vs_trl.QUICK["eval_size"]
    assert (cfg.optim.lr, cfg.loss.kl_beta) == (1e-3, 0.0)
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--eval-every", "0"])


def test_training_prompts_are_the_drivers_draw(vs_trl):
    """TRL must see the kit's problems in the kit's order (the driver's seeded per-iteration sample)."""
    cfg = vs_trl.kit_config(vs_trl.parse_args(["--steps", "3", "--prompts-per-step", "4"]))
    got = vs_trl.training_prompts(cfg)
    d = cfg.data
    pool = data.synthetic_problems(d.train_size, split="train", seed=cfg.run.seed, n_digits=d.n_digits, n_terms=d.n_terms)
    for it, batch in enumerate(got):
        assert batch == loop.iteration_problems(cfg, pool, it)
        assert len(batch) == 4 and all(p in pool for p in batch)
    assert got[0] != got[1]


def test_kit_checkpoint_times_are_the_producing_iterations_end(vs_trl):
    recs = [
        {
            "iteration": 0,
            "version": 1,
            "t_iter_start": 100.0,
            "t_iter_end": 110.0,
            "evals": [{"version": 0, "acc": 0.3}],
        },
        {"iteration": 1, "version": 2, "t_iter_start": 110.0, "t_iter_end": 112.0},
        # version 2's eval lands two iterations later; its time is still iteration 1's end
        {
            "iteration": 2,
            "version": 3,
            "t_iter_start": 112.0,
            "t_iter_end": 115.0,
            "evals": [{"version": 2, "acc": 0.6}],
        },
        {
            "iteration": 3,
            "version": 4,
            "t_iter_start": 115.0,
            "t_iter_end": 117.0,
            "evals": [{"version": 4, "acc": 0.8}],
        },
    ]
    points, wall = vs_trl.kit_checkpoints(recs)
    assert points == [(0, 0.0, 0.3), (2, 12.0, 0.6), (4, 17.0, 0.8)]
    assert wall == 17.0
    # accuracies measured after the run (the default): same clocks, the given accuracies
    points, _ = vs_trl.kit_checkpoints(recs, {0: 0.1, 1: 0.2, 4: 0.9})
    assert points == [(0, 0.0, 0.1), (1, 10.0, 0.2), (4, 17.0, 0.9)]
    cfg = vs_trl.kit_config(vs_trl.parse_args(["--steps", "10", "--eval-every", "4"]))
    assert vs_trl.checkpoint_steps(cfg) == [0, 4, 8, 10]


def test_time_to_target_skips_the_base_model(vs_trl):
    pts = [(0, 0.0, 0.9), (5, 10.0, 0.5), (10, 20.0, 0.88)]
    assert vs_trl.time_to_target(pts, 0.88) == (10, 20.0)
    assert vs_trl.time_to_target(pts, 0.95) is None


def test_report_ends_with_the_json_keys(vs_trl, capsys):
    import json

    cfg = vs_trl.kit_config(vs_trl.parse_args(["--quick"]))
    kit = vs_trl.SideResult("grpo-kit", [(0, 0.0, 0.3), (2, 5.0, 0.7), (4, 9.0, 0.9)], 96, 9.0)
    trl = vs_trl.SideResult("TRL", [(0, 0.0, 0.3), (2, 4.0, 0.8), (4, 8.0, 0.95)], 96, 8.0)
    out = vs_trl.report(cfg, kit, trl, ["a difference"], 1.0, {})
    assert out["target_acc"] == pytest.approx(0.88)
    assert (out["kit_time_to_target_s"], out["trl_time_to_target_s"]) == (9.0, 8.0)
    assert out["time_ratio"] == pytest.approx(9.0 / 8.0)
    printed = capsys.readouterr().out
    assert "a difference" in printed and "time ratio" in printed
    json.dumps(out)  # serialisable


def test_trl_vllm_side_keys_ratio_and_reason(vs_trl, capsys):
    """The third column: kit / TRL vLLM time to target, each TRL side's usable cost beside the kit's, and
    a reason in place of the ratio when TRL vLLM did not reach the target or did not run."""
    cfg = vs_trl.kit_config(vs_trl.parse_args(["--quick"]))
    kit = vs_trl.SideResult("grpo-kit", [(0, 0.0, 0.3), (2, 5.0, 0.7), (4, 9.0, 0.9)], 96, 9.0,
                            {"kit_usable_cost_s": 0.5, "kit_startup_s": 30.0})
    trl = vs_trl.SideResult("TRL", [(0, 0.0, 0.3), (2, 4.0, 0.8), (4, 8.0, 0.95)], 96, 8.0,
                            {"trl_usable_cost_s": 0.25, "trl_frac_zero_std": 0.5})
    vllm = vs_trl.SideResult("TRL vLLM", [(0, 0.0, 0.3), (2, 3.0, 0.85), (4, 6.0, 0.92)], 96, 6.0,
                             {"trl_vllm_usable_cost_s": 0.2, "trl_vllm_frac_zero_std": 0.25, "trl_vllm_startup_s": 50.0})
    out = vs_trl.report(cfg, kit, trl, [], 1.0, {}, trl_vllm=vllm)
    assert out["target_acc"] == pytest.approx(0.88)  # the smallest final accuracy of all three, minus 0.02
    assert out["trl_vllm_time_to_target_s"] == 6.0 and out["time_ratio_vs_trl_vllm"] == pytest.approx(9.0 / 6.0)
    assert out["time_ratio_vs_trl_vllm_reason"] is None and out["time_ratio"] == pytest.approx(9.0 / 8.0)
    assert (out["kit_usable_cost_s"], out["trl_usable_cost_s"], out["trl_vllm_usable_cost_s"]) == (0.5, 0.25, 0.2)
    table = capsys.readouterr().out
    assert "TRL vLLM" in table and "usable cost" in table
    # the lowest final accuracy sets the target for every run: TRL vLLM's 0.6, reached at its last step
    slow = vs_trl.SideResult("TRL vLLM", [(0, 0.0, 0.3), (2, 3.0, 0.5), (4, 6.0, 0.6)], 96, 6.0)
    assert vs_trl.report(cfg, kit, trl, [], 1.0, {}, trl_vllm=slow)["trl_vllm_time_to_target_s"] == 6.0
    empty = vs_trl.SideResult("TRL vLLM")  # no checkpoint: no final accuracy, so no target for anyone
    assert vs_trl.report(cfg, kit, trl, [], 1.0, {}, trl_vllm=empty)["time_ratio_vs_trl_vllm_reason"].startswith("no target")
    out = vs_trl.report(cfg, kit, trl, [], 1.0, {}, failed={"TRL vLLM": "ImportError: no vllm"})
    assert out["time_ratio_vs_trl_vllm"] is None
    assert out["time_ratio_vs_trl_vllm_reason"] == "TRL vLLM did not run: ImportError: no vllm"
    assert "not in --sides" in vs_trl.report(cfg, kit, trl, [], 1.0, {})["time_ratio_vs_trl_vllm_reason"]
    reps = [{"time_ratio_vs_trl_vllm": 1.5, "time_ratio_vs_trl_vllm_reason": None, "trl_vllm_usable_cost_s": 0.2},
            {"time_ratio_vs_trl_vllm": None, "time_ratio_vs_trl_vllm_reason": "why", "trl_vllm_usable_cost_s": 0.3}]
    summary = vs_trl.summarize(reps)
    assert summary["time_ratio_vs_trl_vllm"] is None and summary["time_ratio_vs_trl_vllm_reason"] == "repeat 2: why"
    assert summary["trl_vllm_usable_cost_s"] == 0.3 and summary["trl_vllm_usable_cost_s_all"] == [0.2, 0.3]


def test_trl_usable_cost_is_the_kits_per_step_figure(vs_trl):
    # 2 s over 4 x (1 - 0.5) = 2 usable completions, a step without spread left out, 1 s over 4
    assert vs_trl.usable_cost_per_step([2.0, 3.0, 1.0], [0.5, 1.0, 0.0], 4) == pytest.approx(0.625)
    assert vs_trl.usable_cost_per_step([2.0], [1.0], 4) is None


def test_sides_flag(vs_trl):
    assert vs_trl.parse_args([]).sides == ("kit", "dynamic", "trl", "trl_vllm")
    assert vs_trl.parse_args(["--no-dynamic"]).sides == ("kit", "trl", "trl_vllm")
    assert vs_trl.parse_args(["--sides", "trl_vllm,kit"]).sides == ("kit", "trl_vllm")  # always in SIDES order
    assert vs_trl.parse_args(["--sides", "kit,trl", "--only", "trl_vllm"]).sides == ("trl_vllm",)
    with pytest.raises(SystemExit):
        vs_trl.parse_args(["--sides", "kit,vllm"])
    cfg = vs_trl.kit_config(vs_trl.parse_args([]))
    assert any("TRL vLLM" in d for d in vs_trl.differences(cfg, threads=2))
    assert not any("TRL vLLM" in d for d in vs_trl.differences(cfg, threads=2, trl_vllm=False))


def test_differences_are_strings(vs_trl):
    cfg = vs_trl.kit_config(vs_trl.parse_args([]))
    diffs = vs_trl.differences(cfg, threads=2)
    assert diffs and all(isinstance(d, str) and d for d in diffs)


def test_repeats_report_medians_and_every_value(vs_trl):
    reps = [
        {"kit_time_to_target_s": k, "trl_time_to_target_s": t, "time_ratio": k / t, "x": i}
        for i, (k, t) in enumerate([(5.0, 6.0), (4.0, 8.0), (6.0, 6.0)])
    ]
    out = vs_trl.summarize(reps)
    assert out["time_ratio"] == pytest.approx(5.0 / 6.0)  # median of 0.833, 0.5, 1.0
    assert out["kit_time_to_target_s"] == 5.0 and out["trl_time_to_target_s"] == 6.0
    assert out["time_ratio_all"] == [r["time_ratio"] for r in reps]
    assert out["repeats"] == 3 and out["x"] == 2  # the rest is the last repeat's report
    # a repeat that never reached the target leaves no median
    reps[1] = {**reps[1], "kit_time_to_target_s": None, "time_ratio": None}
    assert vs_trl.summarize(reps)["time_ratio"] is None
    assert vs_trl.parse_args([]).repeats == 3 and vs_trl.parse_args(["--quick"]).repeats == 1


def test_smol_profile_defaults(vs_trl):
    args = vs_trl.parse_args(["--profile", "smol"])
    cfg = vs_trl.kit_config(args)
    smol = config.profile("smol")
    assert cfg.model.model == "smollm2-135m" and cfg.prompt.system_prompt == smol.prompt.system_prompt
    assert (cfg.sampling.prompts_per_step, cfg.sampling.group_size) == (4, 8)  # the profile's, not tiny's 8 x 6
    assert (cfg.optim.lr, cfg.lora.lora_r, cfg.sampling.stop) == (smol.optim.lr, 16, ("\n\n",))
    assert cfg.run.run_dir.endswith("bench-vs-trl-smol/kit")
    assert any("stops:" in d for d in vs_trl.differences(cfg, threads=2))


def test_trl_sees_the_kits_chat_prompts_and_reward(vs_trl):
    """TRL's conversational rows render to the kit's prompt tokens, and its reward function gives the
    kit's reward of the same sample (the text before the stop string, with the lenient credit)."""
    from transformers import AutoTokenizer

    from grpo_kit import models, tasks

    cfg = vs_trl.kit_config(vs_trl.parse_args(["--profile", "smol", "--steps", "2"]))
    rows = [p for batch in vs_trl.training_prompts(cfg) for p in batch]
    tok = AutoTokenizer.from_pretrained(models.resolve_model("smollm2-135m"))
    prompts, reward = vs_trl.trl_inputs(cfg, rows, tok)
    assert isinstance(prompts[0], list) and prompts[0][0]["role"] == "system"
    assert "<|im_start|>assistant" in tok.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=False)
    gold = rows[0].gold
    texts = [f"1 + 1 = {gold}\n#### {gold}", f"1 + 1 = {gold}\n\n#### {gold}", f"#### {int(gold) + 1}"]
    got = reward([[{"role": "assistant", "content": t}] for t in texts], row=[0, 0, 0])
    kit = tasks.for_config(cfg).scorer().score_problems([rows[0]] * 3, [t.split("\n\n")[0] for t in texts])
    assert got == [sc.reward for sc in kit]
    assert got[0] == pytest.approx(1.0 + cfg.reward.format_bonus)  # right after ####, with the format bonus
    assert got[1] < got[0] and got[1] == pytest.approx(cfg.reward.lenient_credit)  # the marker was past the stop
    assert got[2] == pytest.approx(cfg.reward.format_bonus)  # wrong value, marked


def test_tiny_prompts_are_the_kits_plain_text(vs_trl):
    from transformers import AutoTokenizer

    from grpo_kit import models

    cfg = vs_trl.kit_config(vs_trl.parse_args(["--steps", "1"]))
    rows = vs_trl.training_prompts(cfg)[0]
    prompts, reward = vs_trl.trl_inputs(cfg, rows, AutoTokenizer.from_pretrained(models.resolve_model("tiny")))
    assert prompts == [p.prompt for p in rows]
    assert reward([f"#### {rows[1].gold}", "#### x"], row=[1, 1]) == [1.0, 0.0]


# ----------------------------------------------------------------------------- multi-turn benches


def load_bench(name: str):
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_alignment_multi_turn_mode_compares_the_model_tokens_of_whole_episodes(capsys):
    """bench/alignment.py --multi-turn on the HF engine with few tokens: episodes of several turns,
    the multiturn_ keys mirroring the single-turn ones, the stream's environment ids left out."""
    import json

    load_bench("alignment").main(["--multi-turn", "--engines", "hf", "--problems", "2", "--group-size", "1",
                                  "--max-turns", "2", "--max-new-tokens", "48", "--min-tokens", "40"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["multi_turn"] is True
    for k in ("tokens", "ratio_mean", "ratio_std", "max_abs_dlogp", "truncated"):  # the single-turn names
        assert f"multiturn_hf_{k}" in out and f"hf_{k}" not in out
    assert out["multiturn_hf_tokens"] >= 40 and out["multiturn_hf_env_tokens"] > 0
    assert out["multiturn_hf_multi_turn_share"] > 0 and out["multiturn_hf_turns_mean"] > 1
    # env ids (log-prob 0.0 recorded) scored as the model's would be far off: only mask-1 ids compared
    assert out["multiturn_hf_max_abs_dlogp"] <= 1e-3 and abs(out["multiturn_hf_ratio_mean"] - 1) <= 1e-4


def test_multiturn_throughput_measures_both_sides_on_one_engine():
    from grpo_kit import tiny
    from grpo_kit.config import EpisodeConfig
    from grpo_kit.hf_engine import HFEngine

    mt = load_bench("multiturn_throughput")
    engine = HFEngine(str(tiny.ensure_tiny_model()), max_model_len=512)
    cfg = EpisodeConfig(max_turns=2, max_turn_tokens=48, max_episode_tokens=128, tool_workers=1)
    r = mt.measure(engine, data.synthetic_problems(1, split="train", seed=0), group_size=3, tool_latency_s=0.2,
                   repeats=2, warmup=False, episode_cfg=cfg)
    assert r["multiturn_episodes"] == 3 and r["multiturn_tool_calls"] >= 2  # turns ended by EOS called the tool
    # the single side samples at least the tokens it was sized by (on a repeat where it runs first, the
    # previous repeat's multi-turn count: review finding, comparing with this repeat's could fail)
    assert r["multiturn_calls"] >= 2 and r["single_tokens"] >= r["single_target_tokens"] > 0 and r["multiturn_tokens"] > 0
    # the tool calls run one at a time on the runner's single thread, 0.2 s each, inside the wall time
    assert r["multiturn_wall_s"] >= 0.2 * r["multiturn_tool_calls"]
    assert 0 < r["multiturn_engine_busy_share"] < 1
    assert r["multiturn_prompt_tokens"] > r["single_prompt_tokens"] / r["single_calls"]  # later turns re-read the stream
    assert len(r["multiturn_vs_single_tokens_per_s_all"]) == 2 and r["multiturn_vs_single_tokens_per_s"] > 0
    engine.close()


def test_pipelining_repeats_report_per_figure_medians():
    runs = [{"mode": "pipelined", "iter_s": x, "trainer_idle_s": y} for x, y in ((1.0, 0.03), (3.0, 0.01), (2.0, 0.02))]
    assert load_bench("pipelining")._median_run(runs) == {"mode": "pipelined", "iter_s": 2.0, "trainer_idle_s": 0.02}


def test_pipelining_lockstep_floor_pairs_each_step_with_the_next_batchs_generation():
    """bench/pipelining.py's P1 floor: training of batch i runs beside generation of batch i+1."""
    recs = [{"gen_s": 1.0, "train_compute_s": 2.0}, {"gen_s": 3.0, "train_compute_s": 1.0},
            {"gen_s": 0.5, "train_compute_s": 9.0}]
    assert load_bench("pipelining").lockstep_floor(recs) == pytest.approx((3.0 + 1.0) / 2)
    assert math.isnan(load_bench("pipelining").lockstep_floor(recs[:1]))


def test_pipelining_idle_gaps_come_from_the_spans():
    """bench/pipelining.py's idle gaps: the trainer from one step's publish end to the next step's
    start, the rollout worker from a batch's last chunk end to the next batch's first chunk start."""

    def rec(t):  # two chunks of generation, then the trainer's step and publish
        return {"spans": [{"name": "generate", "start": t, "end": t + 0.4}, {"name": "generate", "start": t + 0.1, "end": t + 0.5},
                          {"name": "train", "start": t + 0.52, "end": t + 0.9}, {"name": "publish", "start": t + 0.9, "end": t + 0.95}]}

    gaps = load_bench("pipelining").idle_gaps([rec(0.0), rec(1.0), rec(2.5)])
    # trainer: 1.52 - 0.95 and 3.02 - 1.95; rollout: 1.0 - 0.5 and 2.5 - 1.5
    assert gaps["trainer_idle_s"] == pytest.approx((0.57 + 1.07) / 2)
    assert gaps["rollout_idle_s"] == pytest.approx((0.5 + 1.0) / 2)
    assert load_bench("pipelining").idle_gaps([rec(0.0)]) == {"trainer_idle_s": pytest.approx(float("nan"), nan_ok=True),
                                                              "rollout_idle_s": pytest.approx(float("nan"), nan_ok=True)}
