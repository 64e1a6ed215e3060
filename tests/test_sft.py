"""Supervised fine-tuning on demonstrations, ``algo=sft`` (src/cope/algos/sft): the loss is the untempered
cross-entropy on a demonstration's action tokens; the demo collector's maze episodes are the expert's actions,
token-exact; a trajectories.jsonl is read with its bad lines named, replayed, filtered and drawn deterministically
per (seed, epoch, rank); an env without an expert is refused by name before any env starts; a demonstration that does
not fit the context is counted and skipped; the preset runs through the real entry point and raises the tiny model's
held-out success; the plan experts of the real envs follow their plans."""
from __future__ import annotations

import functools
import importlib.util
import json
import random
import shutil
from types import SimpleNamespace

import pytest
import torch
from tiny_fixtures import maze_factory, tiny_policy

from cope.algos.sft.collector import DemoCollector, skipped_stub
from cope.algos.sft.demos import Demo, check_expert, read_trajectories
from cope.algos.sft.loss import SFTLoss
from cope.batch import collate
from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.episode import Role
from cope.rollout.engine import Sampling
from cope.train.collect.collector import TaskStream
from cope.train.datamodule import RolloutDataModule
from cope.train.module import AgentRLModule
from cope.train.objectives import ForwardOut

CONTEXT = 512
DM = dict(env=maze_factory, tasks_per_epoch=4, group_size=2, minibatch_size=8, max_context=CONTEXT,
          sampling=Sampling(max_action_tokens=4), val_tasks=0, progress=False)
SKIP_KEYS = ("sft/skipped_too_long", "sft/skipped_failed", "sft/skipped_broken")


def demo_datamodule(policy, max_context: int = CONTEXT, env=maze_factory, cap: int = 4, **collector) -> RolloutDataModule:
    dm = RolloutDataModule(**{**DM, "max_context": max_context, "env": env, "sampling": Sampling(max_action_tokens=cap)},
                           collector=functools.partial(DemoCollector, env=env, max_context=max_context, **collector))
    dm.connect(policy)
    return dm


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


@pytest.fixture(scope="module")
def expert_epoch(policy):
    """Epoch 0's expert demonstrations on the maze and the DataModule that collected them."""
    dm = demo_datamodule(policy)
    got = dm.collector.collect(0)
    yield dm, got
    dm.teardown("fit")


def test_expert_demonstrations_are_the_experts_actions_token_exact(policy, expert_epoch):
    dm, got = expert_epoch
    tok, stop = policy.tokenizer, policy.chat.stop_id
    stream = dm.sample_tasks(0)
    assert [e.task for e in got.episodes] == stream.tasks[::2] and got.groups == [0, 1, 2, 3]  # one per task
    for ep in got.episodes:
        assert ep.success and not ep.aborted and ep.sampled_epoch == 0
        env = maze_factory()
        env.reset(ep.task)
        assert len(ep.steps) == len(env.shortest_path())
        for s in ep.steps:
            move = env.expert_action()
            ids = ep.tokens[s.action_start:s.action_end]
            assert s.action_text == move and s.closed and s.valid
            assert ids == [*tok.encode(move, add_special_tokens=False), stop]  # token-exact, stop id included
            assert set(ep.roles[s.action_start:s.action_end]) == {int(Role.ACTION)}
            env.step(move)
    assert got.metrics == {"sft/demos": 4.0, "sft/demo_tokens": float(sum(e.num_action_tokens for e in got.episodes)),
                           **dict.fromkeys(SKIP_KEYS, 0.0)}
    assert not dm.collector.off_policy and dm.collector.state_dict() == {}


@pytest.mark.parametrize("observations", [False, True])
def test_sft_loss_is_the_hand_computed_untempered_cross_entropy(policy, expert_epoch, observations):
    """On a batch of two demonstrations and a skipped (aborted) one, at module.temperature=1 (what algo=sft sets) the
    loss is the mean over every target token of -log softmax(logits) at it: the model's own distribution. A run that
    scored action tokens at its sampling temperature would train another loss (0.5 here)."""
    _, got = expert_epoch
    eps = [got.episodes[0], got.episodes[1], skipped_stub(got.episodes[2])]
    batch = collate(eps, policy.pad_id)
    assert batch["aborted"].tolist() == [False, False, True]
    with torch.no_grad():
        logits = policy.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    want, tempered, n = 0.0, 0.0, 0  # the model's own cross-entropy; the one of action tokens at temperature 0.5
    for i, ep in enumerate(eps[:2]):
        roles = (int(Role.ACTION), int(Role.OBSERVATION)) if observations else (int(Role.ACTION),)
        for t in range(1, len(ep.tokens)):
            if ep.roles[t] in roles:
                tau = 0.5 if ep.roles[t] == int(Role.ACTION) else 1.0
                want -= torch.log_softmax(logits[i, t - 1], -1)[ep.tokens[t]].item()
                tempered -= torch.log_softmax(logits[i, t - 1] / tau, -1)[ep.tokens[t]].item()
                n += 1
    want, tempered = want / n, tempered / n
    assert tempered != pytest.approx(want, rel=1e-4)
    loss_fn = SFTLoss(observations=observations)
    for temperature in (1.0, 0.5):
        module = AgentRLModule(policy, [loss_fn], optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                               temperature=temperature)
        scores = module.logprobs(batch)
        loss, metrics = loss_fn(ForwardOut(scores.logprobs, scores.entropy), batch)
        assert loss.item() == pytest.approx(want if temperature == 1.0 else tempered, rel=1e-5)
        assert metrics["sft/target_tokens"] == n


@pytest.mark.parametrize("override", ["data.sampling.temperature=0.5", "module.temperature=0.7"])
def test_the_preset_refuses_a_tempered_score_before_the_model_is_built(compose, tmp_path, override):
    from cope.run.train import instantiate_named  # what train.py builds the objectives with, before the model

    cfg = compose(["algo=sft"], tmp_path)
    assert cfg.module.temperature == 1.0 and cfg.data.collector._target_ == "cope.algos.sft.collector.DemoCollector"
    assert [(o.name, o.weight) for o in instantiate_named(cfg.algo.objectives, "algo.objectives")] == [
        ("pg", 0.0), ("kl", 0.0), ("sft", 1.0)]
    with pytest.raises(ValueError, match=r"(?s)algo\.objectives\.sft.*module\.temperature=0\.[57]: algo=sft trains the "
                                         r"model's own cross-entropy"):
        instantiate_named(compose(["algo=sft", override], tmp_path).algo.objectives, "algo.objectives")
    assert SFTLoss(temperature=0.0).weight == 1.0  # greedy scores at 1


def test_a_demonstration_too_long_for_the_context_is_counted_and_skipped(policy, expert_epoch):
    _, full = expert_epoch
    lengths = sorted(len(e.tokens) for e in full.episodes)
    limit = (lengths[0] + lengths[-1]) // 2
    assert lengths[0] + 4 + 1 < limit < lengths[-1]  # room for the shortest one's next action
    dm = demo_datamodule(policy, max_context=limit)
    got = dm.collector.collect(0)
    skipped = [e for e in got.episodes if e.aborted]
    assert got.metrics["sft/skipped_too_long"] == len(skipped) >= 1 and got.metrics["sft/demos"] == 4 - len(skipped) >= 1
    for short, full_ep in zip(got.episodes, full.episodes):
        if short.aborted:  # a stub: the first prompt only, no step trained
            assert short.tokens == full_ep.tokens[:full_ep.prompt_len] and not short.steps
        else:  # never truncated: the whole demonstration
            assert short.tokens == full_ep.tokens and len(short.tokens) <= limit
    assert all(len(full_ep.tokens) <= limit for full_ep, e in zip(full.episodes, got.episodes) if not e.aborted)
    mb = dm.collect_epoch(0).minibatches[0]
    assert int(mb["aborted"].sum()) == len(skipped) and not mb["action_mask"][mb["aborted"]].any()
    dm.teardown("fit")


def test_a_demonstration_whose_final_feedback_does_not_fit_is_skipped_as_too_long(policy, expert_epoch):
    """One token short of the longest demonstration: the loop ends it DONE with its final feedback turn dropped
    (``obs_start < 0``); that is a demonstration that does not fit, skipped, not kept with its last observation cut."""
    _, full = expert_epoch
    longest = max(full.episodes, key=lambda e: len(e.tokens))
    dm = demo_datamodule(policy, max_context=len(longest.tokens) - 1)
    got = dm.collector.collect(0)
    stub = got.episodes[full.episodes.index(longest)]
    assert stub.skipped and not stub.steps and got.metrics["sft/skipped_too_long"] >= 1
    assert all(e.tokens == f.tokens for e, f in zip(got.episodes, full.episodes) if not e.aborted)  # never cut
    dm.teardown("fit")


def test_an_action_longer_than_the_sampling_cap_is_skipped_as_too_long(policy, tmp_path):
    """Actions of 2 ids (``south.``) and their stop id under ``data.sampling.max_action_tokens=2``: the sampler counts
    the stop id in its cap (cope.rollout.hf_actor), so the policy could never emit them closed and they are not trained
    (``too_long``); under a cap of 3 they are."""
    env = maze_factory()
    rows = []
    for i in range(2):
        env.reset(Task("maze", "train", i))
        rows.append({"task": f"maze/train/{i}", "turns": [{"action": f"{a}."} for a in env.shortest_path()]})
    path = _write(tmp_path / "dotted.jsonl", rows)
    assert len(policy.tokenizer.encode("south.", add_special_tokens=False)) == 2
    got = demo_datamodule(policy, source="file", path=path, cap=2).collector.collect(0)
    assert got.metrics["sft/skipped_too_long"] == 4 and got.metrics["sft/demos"] == 0
    assert all(e.skipped for e in got.episodes)
    got = demo_datamodule(policy, source="file", path=path, cap=3).collector.collect(0)
    assert got.metrics["sft/demos"] == 4 and all(s.content_len == 2 for e in got.episodes for s in e.steps)


class FlakyExpertMaze(MazeEnv):
    """A maze whose expert raises on its 3rd call (a ScienceWorld JVM hiccup while reading the gold path)."""

    calls = 0

    def expert_action(self):
        FlakyExpertMaze.calls += 1
        if FlakyExpertMaze.calls == 3:
            raise RuntimeError("gold path unreadable")
        return super().expert_action()


def test_an_expert_that_raises_skips_its_demonstration_not_the_run(policy, caplog):
    dm = demo_datamodule(policy, env=functools.partial(FlakyExpertMaze, sizes=[6], max_steps=8))
    with caplog.at_level("WARNING"):
        got = dm.collector.collect(0)
    assert got.metrics["sft/skipped_broken"] == 1 and got.metrics["sft/demos"] == 3
    assert [e.failed for e in got.episodes].count(True) == 1  # an env failure: counted as one, unlike a skip
    assert "FlakyExpertMaze.expert_action() raised RuntimeError('gold path unreadable')" in caplog.text
    dm.teardown("fit")


def test_skipped_demonstrations_are_no_env_failures_for_run_health(policy):
    """An SFT epoch whose demonstrations are all too long for the context: every one a stub that trains nothing, none
    counted as an env abort (``env/aborted_episodes``, ``rollout/aborted``), so the run-health rule that stops runs
    whose env keeps failing (here after one such epoch) does not fire."""
    from cope.callbacks.run_health import RunHealth

    dm = demo_datamodule(policy, max_context=110)
    record = dm.collect_epoch(0)
    module = SimpleNamespace(logged={}, log_dict=lambda d, **kw: module.logged.update(d))
    RunHealth(aborted_epochs=1).on_train_epoch_start(SimpleNamespace(world_size=1, datamodule=SimpleNamespace(
        train_record=record)), module)
    assert module.logged["health/aborted_frac"] == 0.0 and module.logged["health/aborted_streak"] == 0.0
    assert record.metrics["sft/skipped_too_long"] == 4 and all(e.skipped and e.aborted for e in record.episodes)
    assert record.metrics["env/aborted_episodes"] == 0 and record.tally["rollout/aborted"] == 0
    dm.teardown("fit")


class Plain:
    """An env class without expert_action; counts instances (none must be made for the check)."""

    made = 0

    def __init__(self):
        Plain.made += 1


def test_an_env_without_an_expert_is_refused_by_name_before_any_env_starts():
    with pytest.raises(ValueError, match=r"sft\.source=expert needs an env with an expert_action\(\).*Plain has none"):
        DemoCollector(host=None, env=functools.partial(Plain), source="expert")
    assert Plain.made == 0
    from cope.envs.webshop.env import WebShopEnv

    with pytest.raises(ValueError, match="WebShopEnv has none"):
        check_expert(WebShopEnv)
    from cope.envs.alfworld.env import AlfWorldEnv
    from cope.envs.scienceworld.env import ScienceWorldEnv
    from cope.envs.textworld.env import TextWorldEnv

    for cls in (MazeEnv, TextWorldEnv, AlfWorldEnv, ScienceWorldEnv):
        check_expert(functools.partial(cls))  # the class is enough: nothing is built


def _turn_rows(episodes, epoch=0) -> list[dict]:
    return [{"epoch": epoch, "task": e.task.id, "episode": i, "step": j, "action": s.action_text, "valid": s.valid}
            for i, e in enumerate(episodes) for j, s in enumerate(e.steps)]


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GOOD = {"epoch": 0, "task": "maze/train/3", "episode": 0, "step": 0, "action": "north"}


@pytest.mark.parametrize("lines, line, message", [
    ([], None, "the file is empty"),
    (["", "  "], None, "the file is empty"),
    ([GOOD, "{not json"], 2, "not valid JSON"),
    ([GOOD, "[1, 2]"], 2, "not a JSON object but list"),
    ([GOOD, {k: v for k, v in GOOD.items() if k != "step"}], 2, "missing key(s) 'step'"),
    ([{"task": "maze/train/1"}], None, None),  # a turn row without epoch/episode/step/action: line 1
    ([GOOD, {**GOOD, "task": "textworld/train/1", "episode": 1}], 2, "this run's env is 'maze'"),
    ([{**GOOD, "task": "maze/test/1"}], 1, "training draws from the 'train' split"),
    ([{**GOOD, "task": "maze/train/100"}], 1, "has tasks 0..99"),
    ([{**GOOD, "task": "maze-3"}], 1, "a task id is <env>/<split>/<index>"),
    ([GOOD, {**GOOD, "step": 2}], 2, "step 2 of (epoch 0, episode 0) follows step 0"),
    ([{**GOOD, "step": 1}], 1, "follows no step 0"),
    ([GOOD, {**GOOD, "step": 1, "task": "maze/train/4"}], 2, "whose step 0 was 'maze/train/3'"),
    ([{**GOOD, "action": 3}], 1, "'action' must be a string"),
    ([{"task": "maze/train/1", "turns": []}], 1, "'turns' must be a non-empty list"),
])
def test_jsonl_errors_name_the_key_and_the_line(tmp_path, lines, line, message):
    path = _write(tmp_path / "t.jsonl", lines)
    with pytest.raises(ValueError) as err:
        read_trajectories(path, "maze", "train", 100)
    text = str(err.value)
    assert text.startswith(f"sft.path={path!r}: ")
    if line is None and message is None:
        assert "line 1: missing key(s) 'epoch', 'episode', 'step', 'action'" in text
    elif line is None:
        assert message in text
    else:
        assert f": line {line}: " in text and message in text, text
    with pytest.raises(FileNotFoundError, match=r"sft\.path='.*nope\.jsonl': no such file"):
        read_trajectories(tmp_path / "nope.jsonl", "maze", "train", 100)


def test_a_file_that_is_not_utf8_is_refused_naming_the_key_and_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + json.dumps({**GOOD, "step": 1}).encode()[:-3] + b"\xff\"}\n")
    with pytest.raises(ValueError, match=r"^sft\.path='.*t\.jsonl': line 2: not UTF-8 text .*byte 0xff"):
        read_trajectories(path, "maze", "train", 100)


def test_a_file_of_demonstrations_replays_token_exact_and_keeps_the_successes(policy, expert_epoch, tmp_path):
    """Turn rows (a training run's) and episode rows (eval.py's) in one file, concatenated runs included; each kept
    demonstration replays to the transcript the expert made. A failure (out of steps) is kept only with keep=all; an
    episode cut short is never kept."""
    _, got = expert_epoch
    eps = got.episodes
    rows = _turn_rows(eps[:2]) + [{"task": eps[2].task.id, "success": True, "turns": [
        {"action": s.action_text} for s in eps[2].steps]}] + _turn_rows(eps[3:], epoch=0)  # episode 0 again: a new run
    failing = {"task": "maze/train/5", "turns": [{"action": "north"}] * 8}  # 8 actions: max_steps ends it, no success
    cut = {"task": eps[0].task.id, "turns": [{"action": eps[0].steps[0].action_text}]}
    path = _write(tmp_path / "traj.jsonl", [*rows, json.dumps(failing), json.dumps(cut)])
    demos = read_trajectories(path, "maze", "train", 100_000)
    assert [d.task for d in demos] == [e.task for e in eps] + [Task("maze", "train", 5), eps[0].task]
    assert demos[3].where.endswith(f":{sum(e.num_steps for e in eps[:3]) - eps[2].num_steps + 2}")

    dm = demo_datamodule(policy, source="file", path=path)
    c = dm.collector
    assert c.replayed == {"success": 4, "failure": 1, "cut": 1, "early": 0, "error": 0} and len(c.demos) == 4
    out = c.collect(0)
    by_task = {e.task: e for e in eps}
    assert len(out.episodes) == 4 and out.metrics["sft/demos"] == 4
    for ep in out.episodes:
        assert ep.tokens == by_task[ep.task].tokens and ep.roles == by_task[ep.task].roles
    assert len(demo_datamodule(policy, source="file", path=path, keep="all").collector.demos) == 5
    with pytest.raises(ValueError, match=r"sft\.path: none of its 1 episodes is kept with sft\.keep=success"):
        demo_datamodule(policy, source="file", path=_write(tmp_path / "f.jsonl", [json.dumps(failing)]))
    with pytest.raises(ValueError, match=r"sft\.path=.* is read only with sft\.source=file"):
        demo_datamodule(policy, path=path)


class FlakyReplayMaze(MazeEnv):
    """A maze whose 2nd reset raises (a transient env error while ``select_demos`` replays the file)."""

    resets = 0

    def reset(self, task):
        FlakyReplayMaze.resets += 1
        if FlakyReplayMaze.resets == 2:
            raise RuntimeError("transient")
        return super().reset(task)


def test_a_transient_replay_error_does_not_change_the_kept_demonstrations(policy, expert_epoch, tmp_path):
    """A replay the env raised on is kept (judged when an epoch draws it): the kept list, so the draws and the resume
    fingerprint, are those of a run without the error; a file where every replay raises is refused."""
    _, got = expert_epoch
    path = _write(tmp_path / "traj.jsonl", _turn_rows(got.episodes))
    clean = demo_datamodule(policy, source="file", path=path).collector
    FlakyReplayMaze.resets = 0
    flaky = demo_datamodule(policy, source="file", path=path,
                            env=functools.partial(FlakyReplayMaze, sizes=[6], max_steps=8)).collector
    assert flaky.replayed["error"] == 1 and flaky.replayed["success"] == 3
    assert flaky.demos == clean.demos and flaky.fingerprint == clean.fingerprint
    out = flaky.collect(0)  # the errored one replays fine now: trained
    assert out.metrics["sft/demos"] == 4 and [e.tokens for e in out.episodes] == [e.tokens for e in clean.collect(0).episodes]
    FlakyReplayMaze.resets = 1  # the next reset raises: the only demonstration's replay
    with pytest.raises(ValueError, match=r"none of its 1 episodes is kept .*'error': 1"):
        demo_datamodule(policy, source="file", path=_write(tmp_path / "one.jsonl", _turn_rows(got.episodes[:1])),
                        env=functools.partial(FlakyReplayMaze, sizes=[6], max_steps=8))


@pytest.mark.parametrize("invalid", ["skip", "train"])
def test_sft_leaves_out_the_actions_the_env_refused_in_a_successful_demonstration(policy, expert_epoch, tmp_path,
                                                                                   invalid):
    """A file demonstration that first walks into a wall (refused, the agent stays) and then walks the expert's path,
    its first move in prose read by ``env.action_parsing=project``, still succeeds and is kept; with
    ``sft.invalid=skip`` its refused action is no target (``invalid_mask`` covers exactly that step's action ids), the
    rest of it is, the projected answer included (the env accepted it); ``train`` imitates the refused one too."""
    _, got = expert_epoch
    ep = min(got.episodes, key=lambda e: e.num_steps)
    assert ep.num_steps < 8  # room for one more action in max_steps
    env = maze_factory()
    bump = next(m for m in ("north", "south", "east", "west") if (env.reset(ep.task), env.step(m))[1].valid is False)
    moves = [s.action_text for s in ep.steps]
    path = _write(tmp_path / "bump.jsonl", [{"task": ep.task.id, "turns": [{"action": a} for a in
                                                                            [bump, f"I think {moves[0]}", *moves[1:]]]}])
    projecting = functools.partial(MazeEnv, sizes=[6], max_steps=8, action_parsing="project")
    demo = demo_datamodule(policy, source="file", path=path, env=projecting, cap=8).collector.collect(0).episodes[0]
    assert demo.success and not demo.steps[0].valid and all(s.strict for s in demo.steps[2:])
    assert demo.steps[1].valid and not demo.steps[1].strict  # projected: valid, trained
    batch = collate([demo], policy.pad_id)
    bad = demo.steps[0]
    want_invalid = torch.zeros_like(batch["action_mask"])
    want_invalid[0, bad.action_start:bad.action_end] = True
    assert torch.equal(batch["invalid_mask"], want_invalid) and bool(batch["action_mask"][0, bad.action_start])
    logprobs = torch.randn(batch["input_ids"].shape)
    loss, metrics = SFTLoss(invalid=invalid)(ForwardOut(logprobs, torch.zeros_like(logprobs)), batch)
    targets = batch["action_mask"] & ~want_invalid if invalid == "skip" else batch["action_mask"]
    assert loss.item() == pytest.approx(-(logprobs[targets]).mean().item(), rel=1e-6)
    assert metrics["sft/target_tokens"] == int(targets.sum())
    assert metrics.get("sft/invalid_tokens", 0) == (bad.action_end - bad.action_start if invalid == "skip" else 0)
    with pytest.raises(ValueError, match=r"algo\.objectives\.sft\.invalid .* must be one of \('skip', 'train'\)"):
        SFTLoss(invalid="mask")


def _host(world: int, rank: int, seed: int = 0):
    return SimpleNamespace(world=lambda: world, rank=lambda: rank,
                           task_stream=lambda e: TaskStream([], [], random.Random(e)))


def test_file_draws_are_shuffled_passes_split_over_ranks_and_the_same_after_a_resume(tmp_path):
    """Epoch e of rank r takes slice e*W + r of the concatenated permutations: over two ranks, an epoch's draws are
    disjoint, each pass covers every demonstration once, and a new collector (a resumed run) draws the same. The state
    is the file's fingerprint, which a resume on another file refuses."""
    demos = [Demo(Task("maze", "train", i), ("north",), f"x:{i}") for i in range(10)]

    def collector(rank: int, seed: int = 7) -> DemoCollector:
        c = DemoCollector.__new__(DemoCollector)  # the drawing alone, without reading or replaying a file
        c.host, c.demos, c.seed, c._perms = _host(2, rank), demos, seed, {}
        return c

    n = 3
    draws = {(e, r): [d.task.index for d in collector(r)._draw(e, n)] for e in range(5) for r in range(2)}
    flat = [i for e in range(5) for r in range(2) for i in draws[e, r]]  # 30 positions = 3 passes of 10
    assert all(sorted(flat[k * 10:(k + 1) * 10]) == list(range(10)) for k in range(3))
    assert flat[:10] != list(range(10)) and flat[:10] != flat[10:20]  # shuffled, each pass its own order
    assert not set(draws[0, 0]) & set(draws[0, 1])
    resumed = collector(1)
    assert [d.task.index for d in resumed._draw(3, n)] == draws[3, 1]
    assert [d.task.index for d in collector(1, seed=8)._draw(3, n)] != draws[3, 1]

    c = collector(0)
    c.fingerprint = "abc/keep=success/10"
    assert c.state_dict() == {"sft_demos": "abc/keep=success/10"}
    c.load_state_dict({"counters": {}, "sft_demos": "abc/keep=success/10"})
    c.load_state_dict({"counters": {}})  # a checkpoint of another collector
    with pytest.raises(ValueError, match="resume with the same file and sft.keep"):
        c.load_state_dict({"counters": {}, "sft_demos": "def/keep=success/9"})


def test_expert_demonstrations_are_the_same_after_a_resume(policy, expert_epoch):
    """The expert's tasks come from the DataModule's task stream (seed, rank, epoch): a new collector's epoch 0 is the
    first one's, and epoch 1 draws other tasks."""
    _, got = expert_epoch
    dm = demo_datamodule(policy)
    again = dm.collector.collect(0)
    assert [e.tokens for e in again.episodes] == [e.tokens for e in got.episodes]
    assert [e.task for e in dm.collector.collect(1).episodes] != [e.task for e in got.episodes]
    dm.teardown("fit")


@pytest.mark.long
def test_algo_sft_through_the_entry_point_raises_held_out_success(run_train, read_metrics, tmp_path):
    """``train.py algo=sft debug=fast`` with 32 expert demonstrations per epoch (one per task) for eight epochs (32
    optimizer steps): the SFT loss and the sft/* metrics are logged every step and epoch, no policy-gradient loss, the
    adapter is exported for ``model.adapter=`` of a next run, and the warm-started micro model, which solves none of
    32 held-out mazes at the start, solves some (6 of 32 with this seed)."""
    result = run_train(["algo=sft", "trainer.max_epochs=8", "trainer.check_val_every_n_epoch=8", "data.tasks_per_epoch=32",
                        "data.val_tasks=32", "data.val_batch_size=32", "module.optimizer.lr=3e-3"], tmp_path)
    assert result["counters/episodes"] == 8 * 32  # epochs x data.tasks_per_epoch: data.group_size (4) is not used
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert len(cols["loss/sft"]) == 8 * 4 and "loss/pg" not in cols
    assert cols["sft/demos"] == [32.0] * 8 and all(cols[k] == [0.0] * 8 for k in SKIP_KEYS)
    assert (tmp_path / "csv" / "adapter" / "adapter_model.safetensors").exists()
    assert result["start/val/success"] == 0.0 and result["val/success"] > 0.1, result


# -- the plan experts of the real envs -------------------------------------------------------------------------------
def _follows_its_plan(env, task, plan: list[str]) -> None:
    """expert_action() walks ``plan`` to a success, asking twice changes nothing; off the plan it has no answer."""
    env.reset(task)
    for action in plan:
        assert env.expert_action() == env.expert_action() == action
        out = env.step(action)
        if out.done:
            break
    assert out.success and env.expert_action() is None
    env.reset(task)
    env.step("xyzzy")
    assert env.expert_action() is None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("textworld") is None, reason="needs the textworld package")
def test_textworld_expert_follows_the_walkthrough(tmp_path):
    from cope.envs.textworld.env import TextWorldEnv

    env = TextWorldEnv(cache_dir=str(tmp_path), max_steps=50)
    env.reset(Task("textworld", "train", 0))
    _follows_its_plan(env, Task("textworld", "train", 0), env.walkthrough())
    env.close()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("alfworld") is None, reason="needs the alfworld package")
def test_alfworld_expert_follows_the_stored_plan(tmp_path):
    from cope.envs.alfworld.env import AlfWorldEnv

    env = AlfWorldEnv(source="generated", cache_dir=str(tmp_path))
    env.reset(Task("alfworld-generated", "train", 1))
    _follows_its_plan(env, Task("alfworld-generated", "train", 1), env.expert_plan())
    env.close()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("scienceworld") is None or shutil.which("java") is None,
                    reason="needs the scienceworld package and Java")
def test_scienceworld_expert_follows_the_gold_path_without_disturbing_the_episode():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    env = ScienceWorldEnv(tasks=["find-animal"], max_steps=100)
    try:
        task = Task("scienceworld", "train", 0)
        gold = env.gold_actions(task)
        env.reset(task)
        plain = [env.step(a).observation for a in gold[:3]]
        env.reset(task)
        env.step(gold[0])
        assert env.expert_action() == gold[1]  # read mid-episode: the task is reloaded and its commands replayed
        assert [env.step(a).observation for a in gold[1:3]] == plain[1:]  # the episode goes on as it would have
        _follows_its_plan(env, task, gold)
    finally:
        env.close()
