"""ECHO without a verifier (``algo=echo_only``): the observation loss alone, action tokens exactly zero gradient, the
clean-rollout filter, the rule that refuses another objective that is on, and training on the held-out split."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from cope.algos.echo import ObservationLoss
from cope.episode import Role
from cope.run.config_check import check_config
from cope.run.config_keys import ConfigError
from cope.train.objectives import ForwardOut, check_objectives, combine

P, A, O, H, X = int(Role.PROMPT), int(Role.ACTION), int(Role.OBSERVATION), int(Role.HARNESS), int(Role.PAD)
ROLES = torch.tensor([
    [P, A, A, O, O, H, P, A, O],
    [P, A, O, O, P, A, A, O, X],
    [P, A, O, X, X, X, X, X, X],
])


def _batch(unclean_steps=(0, 0, 0)) -> dict:
    action = ROLES == A
    return {"roles": ROLES, "action_mask": action, "advantages": action.float() * torch.tensor([[1.0], [-1.0], [0.5]]),
            "aborted": torch.zeros(3, dtype=torch.bool), "aux_row": torch.zeros(3, dtype=torch.bool),
            "unclean_steps": torch.tensor(unclean_steps), "old_logprobs": torch.full(ROLES.shape, -1.0)}


def _objectives(compose, tmp_path, overrides=()):
    cfg = compose(["algo=echo_only", *overrides], tmp_path)
    objectives = [instantiate(node) for node in cfg.algo.objectives.values()]
    check_objectives(objectives)
    return cfg, objectives


def test_action_tokens_get_exactly_zero_gradient(compose, tmp_path):
    """The preset's objectives, summed as the module sums them: the gradient reaches observation tokens only (the
    same batch under algo=echo moves action tokens: the test can fail)."""
    _, objectives = _objectives(compose, tmp_path)
    lp = torch.full(ROLES.shape, -1.5, requires_grad=True)
    out = ForwardOut(logprobs=lp, entropy=torch.zeros(ROLES.shape))
    total, metrics = combine(objectives, out, _batch(), step=0)
    total.backward()
    assert "loss/pg" not in metrics and "loss/kl" not in metrics and "loss/echo" in metrics
    assert torch.equal(lp.grad[ROLES == A], torch.zeros(int((ROLES == A).sum())))
    assert bool((lp.grad[ROLES == O] < 0).all())  # every observation token is a target
    assert torch.equal(lp.grad[(ROLES != O)], torch.zeros(int((ROLES != O).sum())))

    echo = [instantiate(n) for n in compose(["algo=echo"], tmp_path).algo.objectives.values()]
    lp2 = torch.full(ROLES.shape, -1.5, requires_grad=True)
    combine(echo, ForwardOut(logprobs=lp2, entropy=torch.zeros(ROLES.shape)), _batch(), step=0)[0].backward()
    assert lp2.grad[ROLES == A].abs().sum() > 0  # with the policy gradient on, action tokens move


def test_clean_only_leaves_rows_with_an_invalid_action_out():
    lp = torch.full(ROLES.shape, -1.5)
    out = ForwardOut(logprobs=lp, entropy=torch.zeros(ROLES.shape))
    all_rows = ObservationLoss(weight=1.0)(out, _batch((0, 2, 0)))[0]
    clean, metrics = ObservationLoss(weight=1.0, clean_only=True)(out, _batch((0, 2, 0)))
    # rows 0 and 2 only: 1.5 * 3 / 4 (the harness token in the denominator) and 1.5 * 1 / 1
    assert clean.item() == pytest.approx((1.5 * 3 / 4 + 1.5) / 2)
    assert all_rows.item() == pytest.approx((1.5 * 3 / 4 + 1.5 * 3 / 3 + 1.5) / 3)
    assert float(metrics["echo/clean_rows"]) == 2


def test_a_projected_answer_makes_its_rollout_unclean():
    """Under env.action_parsing=project the maze reads a prose answer as a move (valid, projected): the clean filter
    must leave that rollout out, as it does a refused one (the paper: no malformed tool call)."""
    from tiny_fixtures import tiny_chat, tiny_tokenizer

    from cope.batch import collate
    from cope.envs.base import Task
    from cope.envs.maze import MazeEnv
    from cope.rollout.loop import run_episodes

    tok, chat, task = tiny_tokenizer(), tiny_chat(), Task("maze", "train", 0)
    move = MazeEnv(sizes=[6], max_steps=1, min_distance=1, action_parsing="project").reset(task).admissible_actions[0]
    answers = [move, f"Let me think. The best move is {move} because it is closer.", "xyz"]

    def actor(contexts, admissible, keys):
        return [list(tok.encode(answers[k], add_special_tokens=False)) + [chat.stop_id] for k in keys]

    envs = [MazeEnv(sizes=[6], max_steps=1, min_distance=1, action_parsing="project") for _ in answers]
    eps, _ = run_episodes(envs, [task] * 3, [0, 1, 2], actor, tok, chat, max_context=2048, max_action_tokens=32)
    assert [(s.valid, s.projected) for e in eps for s in e.steps] == [(True, False), (True, True), (False, False)]
    batch = collate(eps, 0)
    assert batch["unclean_steps"].tolist() == [0, 1, 1]
    lp = torch.full(batch["roles"].shape, -1.5)
    _, metrics = ObservationLoss(weight=1.0, clean_only=True)(ForwardOut(logprobs=lp, entropy=torch.zeros(lp.shape)),
                                                              batch)
    assert float(metrics["echo/clean_rows"]) == 1  # the strict rollout only


def test_another_objective_on_is_refused_before_any_work(compose, tmp_path):
    for overrides, key in ((["algo.objectives.pg.weight=1.0"], "algo.objectives.pg.weight"),
                           (["+algo.objectives.kl.final_weight=0.1", "+algo.objectives.kl.schedule=linear",
                             "+algo.objectives.kl.schedule_steps=4"], "algo.objectives.kl.final_weight")):
        cfg = compose(["algo=echo_only", *overrides], tmp_path)
        with pytest.raises(ConfigError) as e:
            check_config(cfg)
        assert any(p.startswith(key) for p in e.value.problems), e.value.problems
        with pytest.raises(ValueError, match="trains alone"):  # and the module's own check, defence in depth
            check_objectives([instantiate(n) for n in cfg.algo.objectives.values()])
    check_config(compose(["algo=echo_only"], tmp_path))  # the preset itself passes


def test_train_split(compose, tmp_path):
    cfg = compose(["data.train_split=test"], tmp_path)
    dm = instantiate(cfg.data, env=instantiate(cfg.env))
    assert {t.split for t in dm.sample_tasks(0).tasks} == {"test"} and dm.num_train_tasks == dm.num_test_tasks
    dm.teardown("fit")
    cfg = compose(["data.train_split=val"], tmp_path)
    with pytest.raises(Exception, match="data.train_split"):
        instantiate(cfg.data, env=instantiate(cfg.env))


@pytest.mark.long
@pytest.mark.parametrize("lag", [0, 1])
def test_echo_only_trains_on_the_held_out_split(run_train, read_metrics, tmp_path, lag):
    """Two epochs on test tasks: the observation loss trains the adapter, no policy-gradient term is computed; also
    with overlapped rollouts (data.max_lag=1)."""
    from safetensors.torch import load_file

    result = run_train(["algo=echo_only", "data.train_split=test", "algo.objectives.echo.clean_only=false",
                        "trainer.max_epochs=2", f"data.max_lag={lag}"], tmp_path)
    assert max(read_metrics(tmp_path / "csv" / "metrics.csv").get("rollout/lag_max", [0])) == lag
    assert result["counters/episodes"] == 2 * 2 * 4
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert cols.get("loss/echo") and all(v > 0 for v in cols["loss/echo"]) and not cols.get("loss/pg"), sorted(cols)
    lora_b = [v for k, v in load_file(str(tmp_path / "csv" / "adapter" / "adapter_model.safetensors")).items()
              if "lora_B" in k]
    assert any(v.abs().sum() > 0 for v in lora_b)
