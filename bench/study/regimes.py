"""The study's regimes: what every run of a regime gets (its overrides, budget, panels, seeds and search), the arms'
algo configs and their search grids. Read by the launcher (:mod:`bench.study.launch`, whose docstring describes each
regime) and the report."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST_SEEDS, TUNE_SEEDS = (0, 1, 2, 3, 4), (100,)
TEST_PANEL, TUNE_PANEL = ("data.val_offset=0", "data.val_tasks=256"), ("data.val_offset=500", "data.val_tasks=256")
BUDGET = ("trainer.max_epochs=16", "trainer.check_val_every_n_epoch=4", "data.val_batch_size=128")
COMMON = ("data.progress=false", "callbacks.grad_stats.every_n_steps=4", "~callbacks.trajectory_table")  # grad/*: 1st step of each epoch
PRIOR_EXPERT_PROB = 0.35  # the noise level of regime (b): greedy held-out success 0.289 at the start (bench/results/warm_start_prior.json)
TEN_M = ("model.hidden_size=384", "model.num_layers=6", "model.num_heads=6")  # 10.3M parameters with the maze vocab


MAZE_SIZES = (6, 7, 8)  # conf/env/maze.yaml: each task draws one
SMOKE = ("trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1", "data.tasks_per_epoch=2", "data.group_size=4",
         "data.minibatch_size=8", "model.warm_start_steps=5", "env.max_steps=6", "callbacks.probes.max_episodes=2")
SMOKE_PANEL = ("data.val_tasks=4",)
SMOKE_EVAL = 1  # --smoke: tasks of each test run's final evaluation (a regime's final_eval > 0); eval.py's startup is most of it


@dataclass(frozen=True)
class Regime:
    """One regime of the study. Everything a run of it gets is here: its overrides, budget, panels, seeds and
    search, so regimes on different models (the tiny model, SmolLM2) share the launcher, records and report."""

    title: str
    overrides: tuple[str, ...]
    threshold: float  # held-out success for "episodes to threshold", fixed before any run
    arms: tuple[str, ...] = ("grpo", "cope", "echo")
    tuned_in: str | None = None  # reuse another regime's tuning (None: tune here)
    by_size: tuple[int, ...] | None = MAZE_SIZES  # also report per maze size (the env's sizes; None: one size)
    fixed: tuple[tuple[str, str], ...] = ()  # (arm, GRID label) per arm: settings chosen by an earlier tuning, not tuned again
    budget: tuple[str, ...] = BUDGET  # epochs and validation cadence of every run
    panels: tuple[tuple[str, ...], tuple[str, ...]] = (TUNE_PANEL, TEST_PANEL)  # (tuning, reported) held-out tasks
    seeds: tuple[tuple[int, ...], tuple[int, ...]] = (TUNE_SEEDS, TEST_SEEDS)  # (tuning, test) seeds
    grid: tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...] = ()  # per arm: (label, overrides) replacing GRID's
    arm_overrides: tuple[tuple[str, tuple[str, ...]], ...] = ()  # per arm: overrides of every run of that arm here
    smoke: tuple[str, ...] = SMOKE  # --smoke: the miniature budget
    smoke_size: tuple[int, int] = (2, 2)  # --smoke: settings per arm searched (1: the first, no tuning run), test seeds
    final_eval: int = 0  # > 0: each test run's final adapter is evaluated greedily on this many test tasks (eval.py)
    equal_env_steps: bool = False  # also compare the arms at equal env steps (bench/study/equal_steps.py)

    def search(self, arm: str) -> dict[str, tuple[str, ...]]:
        """The arm's settings in this regime (label -> overrides)."""
        return dict(dict(self.grid).get(arm, ())) or GRID[arm]


SPEC: dict[str, Regime] = {
    # (a): GRPO vs ECHO only (ECHO's claim, per maze size); CoPE left out for the budget (the earlier 3-seed
    # study, bench/results/sample_efficiency, ran it in this regime)
    "random": Regime("(a) warm start = uniform random walker", (), 0.15, ("grpo", "echo"), tuned_in="prior"),
    "prior": Regime(f"(b) warm start = BC on noisy goal-directed walks (expert p={PRIOR_EXPERT_PROB})",
                    ("model.warm_start_policy=expert", f"model.warm_start_expert_prob={PRIOR_EXPERT_PROB}"), 0.5),
    **{f"echo{n}": Regime(f"ECHO's maze: ~10M model, {n}x{n} mazes", (*TEN_M, f"env.sizes=[{n}]"), 0.15,
                          ("grpo", "echo"), tuned_in="prior", by_size=None) for n in MAZE_SIZES},
}
# The CoPE study of 2026-12-02 (study2): the prior regime's budget and panels, GRPO against CoPE as its authors
# built it and the continuation reading, all three on today's code (its own --out/--records: the runs above were
# made before the task streams became per (seed, rank, epoch), so they cannot be paired with new runs).
SPEC["cope"] = Regime("(b') prior warm start: GRPO vs CoPE (authors') vs CoPE (continuation)", SPEC["prior"].overrides,
                      SPEC["prior"].threshold, ("grpo", "cope_authors", "cope"))
# The re-check after the demo's collapse was fixed (study3): study2's regime on the code whose default no longer
# collapses (pg.agg seq-mean-token-mean, module.max_approx_kl 0.03: the epoch's trust region drops policy steps,
# CoPE's forecast steps still run),
# with study2's tuned settings (GRPO lr 1e-3, CoPE lr_scale 0.3; no re-tuning), the turns layout in place of the
# continuation arm. Run on its own: --regimes cope_recheck --out outputs/study3 --records bench/results/study3/runs
# --results bench/results/study3.
SPEC["cope_recheck"] = Regime("(b'') prior warm start, after the fix of the demo's collapse: GRPO vs CoPE (authors', list) vs CoPE "
                              "(authors', turns)",
                              # a collapsed run trains to its end (what it measures), whatever run_health's default
                              (*SPEC["prior"].overrides, "callbacks.run_health.invalid_epochs=null"), SPEC["prior"].threshold,
                              ("grpo", "cope_authors", "cope_turns"),
                              fixed=(("grpo", "lr1e-3"), ("cope_authors", "lrs0.3"), ("cope_turns", "lrs0.3")))
# CoPE on a real instruct model (study4): SmolLM2-135M-Instruct, which reads the plan-ahead prompt, on mazes
# calibrated for it (bench/README.md has the calibration and every decision). Run on its own, from a fixed commit:
# --regimes smollm2 --out outputs/study4 --records bench/results/study4/runs --results bench/results/study4.
SMOLLM2_MAZE = ("model=smollm2-135m", "experiment=smollm2_maze", "env.sizes=[6]", "env.min_distance=2", "env.max_steps=8")
SPEC["smollm2"] = Regime(
    "SmolLM2-135M-Instruct, 6x6 mazes, goal 2-8 moves away: GRPO vs CoPE (authors', list) vs CoPE (authors', turns) vs ECHO",
    (*SMOLLM2_MAZE, "callbacks.run_health.invalid_epochs=null"),  # a collapsing run trains to its end (what it measures)
    0.4, ("grpo", "cope_authors", "cope_turns", "echo"), by_size=None,
    budget=("trainer.max_epochs=12", "trainer.check_val_every_n_epoch=3", "data.val_batch_size=32"),
    panels=(("data.val_offset=500", "data.val_tasks=32"), ("data.val_offset=0", "data.val_tasks=64")),
    seeds=((100,), (0, 1, 2, 3, 4)),
    grid=(("grpo", (("lr5e-4", ("module.optimizer.lr=5e-4",)), ("lr1e-3", ("module.optimizer.lr=1e-3",)))),
          ("cope_authors", (("lrs0.3", ("cope.lr_scale=0.3",)), ("lrs1.0", ("cope.lr_scale=1.0",)))),
          ("cope_turns", (("lrs0.3", ("cope.lr_scale=0.3", "cope.layout=turns")),
                          ("lrs1.0", ("cope.lr_scale=1.0", "cope.layout=turns")))),
          # ECHO's lambda: the paper's 0.05 and the conf's advice for a larger model, 0.005
          ("echo", (("lam0.005", ("algo.objectives.echo.weight=0.005",)), ("lam0.05", ("algo.objectives.echo.weight=0.05",))))),
    # SmolLM2's maze answers are read by the projection: counted as invalid, they would leave no forecast sample
    arm_overrides=(("cope_authors", ("cope.mask_projected=false",)), ("cope_turns", ("cope.mask_projected=false",))),
    smoke=("trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1", "data.tasks_per_epoch=1", "data.group_size=2",
           "data.minibatch_size=2", "env.max_steps=3", "data.sampling.max_action_tokens=8", "data.val_batch_size=4",
           "callbacks.probes.max_episodes=2"),
    smoke_size=(1, 1), final_eval=256)
# The papers' comparison set (study5): study4's SmolLM2 regime with GRPO against RWML then GRPO (RWML
# paper's "RWML + policy RL", 4 of the 12 epochs world-model RL on the epoch's own transitions: equal env steps),
# WM-SFT beside GRPO (the CoPE authors' code's next-observation loss), ECHO, and GRPO on an SFT'd model (4 epochs of
# behaviour cloning of the maze's expert first, bench/study/stages.py: ECHO's "share of the SFT gain recovered").
# GRPO and ECHO at study4's chosen settings, the new arms at one setting each (no tuning: say so in the report).
# Run on its own: --regimes baselines --out outputs/study5 --records bench/results/study5/runs --results bench/results/study5.
# `baselines_tiny` is the same design on the tiny model's prior regime: plumbing only (the tiny model cannot read a
# world-model prompt), and the launcher's smoke test.
BASELINE_ARMS = ("grpo", "rwml_grpo", "wm_sft", "echo", "grpo_sft")


def _baselines(rwml_epochs: int) -> dict:
    """The arms' one setting each (grid) and the choice of it (fixed): GRPO's lr and ECHO's lambda are study4's."""
    grid = (("grpo", (("lr1e-3", ("module.optimizer.lr=1e-3",)),)),
            ("rwml_grpo", ((f"rwml{rwml_epochs}", (f"rwml.epochs={rwml_epochs}",)),)),
            ("wm_sft", (("w0.01", ("wm_sft.weight=0.01",)),)),
            ("echo", (("lam0.005", ("algo.objectives.echo.weight=0.005",)),)),
            ("grpo_sft", (("lr1e-3", ()),)))
    return {"arms": BASELINE_ARMS, "grid": grid, "fixed": tuple((arm, next(iter(dict(g)))) for arm, g in grid)}


SPEC["baselines"] = dataclasses.replace(
    SPEC["smollm2"], title="SmolLM2-135M-Instruct, 6x6 mazes: GRPO vs RWML+GRPO vs WM-SFT+GRPO vs ECHO vs GRPO on expert SFT",
    arm_overrides=(), **_baselines(4))
SPEC["baselines_tiny"] = Regime("plumbing of `baselines` on the tiny model (prior warm start)", SPEC["prior"].overrides,
                                SPEC["prior"].threshold, by_size=None, smoke_size=(1, 1), **_baselines(1))
# Branched rollouts' learning bench: the default demo (`python train.py`: GRPO on the maze, random-walk
# warm start, 60 epochs, the demo's own lr) with flat groups against the branching collector at its defaults (2 roots,
# uniform trigger, G=8 leaves). Equal epochs and leaves; the trees take fewer env steps, so the report also reads every
# arm's held-out success at the env steps of the cheapest arm (bench/study/equal_steps.py). Validated every 5 epochs
# for a finer curve against env steps. Run on its own: --regimes branching --out outputs/branch_learning
# --records bench/results/branch_learning/runs --results bench/results/branch_learning.
SPEC["branching"] = Regime(
    "the default demo (tiny model, maze, random-walk warm start): flat GRPO groups vs branched groups (2 roots, uniform)",
    (), 0.3, ("grpo", "grpo_branch"), budget=("trainer.max_epochs=60", "trainer.check_val_every_n_epoch=5"),
    panels=(TUNE_PANEL, ("data.val_offset=0", "data.val_tasks=128")),
    grid=(("grpo", (("demo", ()),)), ("grpo_branch", (("roots2", ()),))),
    fixed=(("grpo", "demo"), ("grpo_branch", "roots2")),
    arm_overrides=(("grpo_branch", ("+collector=branching",)),), smoke_size=(1, 1), equal_env_steps=True)
DEFAULT_REGIMES = ("prior", "random")  # tuning (in prior) first, then prior's test runs, then random's
# The algo config an arm runs: "cope" is the reading of the explainer the first runs measured (algo=cope_continuation;
# its records are committed), "cope_authors" CoPE as its authors built it (algo=cope since 2026-12-02).
ARM_ALGO = {"cope": "cope_continuation", "cope_authors": "cope", "cope_turns": "cope", "grpo_sft": "grpo",
            "grpo_branch": "grpo"}
# Each arm's search: the same number of settings (label -> overrides). CoPE and ECHO add GRPO's chosen lr.
GRID: dict[str, dict[str, tuple[str, ...]]] = {
    "grpo": {f"lr{lr}": (f"module.optimizer.lr={lr}",) for lr in ("3e-4", "1e-3", "3e-3")},
    "cope": {
        "w0.1_K3": ("cope.weight=0.1", "cope.K=3"),
        "w0.3_K2": ("cope.weight=0.3", "cope.K=2"),
        "gradnorm0.3_K3": ("cope.normalize=gradnorm", "cope.weight=1.0", "cope.adaptive_ratio=0.3", "cope.K=3"),
    },
    # the authors' separate forecast step: Adam normalizes the coefficient away, the learning-rate scale sizes it
    "cope_authors": {f"lrs{s}": (f"cope.lr_scale={s}",) for s in ("0.3", "1.0", "3.0")},
    "cope_turns": {f"lrs{s}": (f"cope.lr_scale={s}", "cope.layout=turns") for s in ("0.3", "1.0", "3.0")},  # same, turns layout
    "echo": {f"lam{lam}": (f"algo.objectives.echo.weight={lam}",) for lam in ("0.005", "0.02", "0.05")},
}
