"""HeldOutProbes under DDP: 2 CPU processes (gloo), each calling the callback's real
``on_validation_epoch_end`` with a real ``DDPStrategy`` for the reduction; rank 1's held-out share has no
successful episode (no forecast chunk). Both ranks must log the same keys, without a hang, with the pooled
means over both ranks' rows (not the mean of the two ranks' means)."""
from __future__ import annotations

import datetime
import functools
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS, K = 2, 3
COLLECTIVE_TIMEOUT_S, TIMEOUT_S = 60, 300  # a hung reduction raises after the first; imports under load take most of the second
KEYS = ("probe/forecast_chunks", "probe/obs_nll", "probe/forecast_token_acc", "probe/forecast_action_acc",
        "probe/obs_tokens", "probe/forecast_tokens", "probe/forecast_actions")


def _rank(rank: int, world: int, port: int, out: str, shares: list, everything: list) -> None:
    """One DDP rank: probe this rank's share, reduce through the real strategy, record what is logged."""
    from lightning.pytorch.strategies import DDPStrategy
    from tiny_fixtures import tiny_chat, tiny_policy, tiny_tokenizer

    from cope.algos.grpo import PolicyGradient
    from cope.callbacks.probes import HeldOutProbes
    from cope.records import ValidationRecord
    from cope.train.module import AgentRLModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        policy = tiny_policy(seed=0)  # the same weights on every rank, as DDP keeps them
        module = AgentRLModule(policy, [PolicyGradient()], optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                               max_tokens_per_microbatch=1024)
        logged = []
        module.log_dict = lambda metrics, **kw: logged.append((dict(metrics), kw))  # what Lightning would get
        record = ValidationRecord(epoch=0, episodes=shares[rank])
        trainer = SimpleNamespace(sanity_checking=False, datamodule=SimpleNamespace(val_record=record),
                                  strategy=DDPStrategy())
        probes = HeldOutProbes(sample="continuation", K=K)
        probes.on_validation_epoch_end(trainer, module)
        result = {"logged": [[m, {k: v for k, v in kw.items() if isinstance(v, (bool, int, float, str))}] for m, kw in logged],
                  "local": probes.probe(module, shares[rank], tiny_chat(), tiny_tokenizer().pad_token_id)}
        if rank == 0:  # the pooled truth: one process probing every rank's episodes
            result["all"] = probes.probe(module, everything, tiny_chat(), tiny_tokenizer().pad_token_id)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
@pytest.mark.ddp
def test_probes_same_keys_and_pooled_mean_across_ranks(tmp_path):
    from tiny_fixtures import Scripted, maze_factory, maze_tasks, tiny_chat, tiny_tokenizer

    from cope.rollout.loop import run_episodes

    tok, chat = tiny_tokenizer(), tiny_chat()  # the episodes are built here, once, and sent to the ranks
    tasks = maze_tasks(4, "test")
    scripts = {}
    for i, task in enumerate(tasks[:3]):
        env = maze_factory()
        env.reset(task)
        scripts[i] = [tok(d, add_special_tokens=False)["input_ids"] + [chat.stop_id] for d in env.shortest_path()]
    scripts[3] = [tok("jump", add_special_tokens=False)["input_ids"] + [chat.stop_id]]  # malformed: a failure
    eps, _ = run_episodes([maze_factory() for _ in tasks], tasks, list(range(4)), Scripted(scripts), tok, chat,
                          max_context=1024, max_action_tokens=6)
    assert [e.success for e in eps] == [True, True, True, False]
    shares = [eps[:3], eps[3:]]  # rank 1: one failed episode, no forecast chunk

    ctx = mp.start_processes(_rank, args=(RANKS, _free_port(), str(tmp_path), shares, eps), nprocs=RANKS,
                             join=False, start_method="spawn")
    end = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > end:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the probe's reduction hung (no result within {TIMEOUT_S} s)")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]

    local = [r["local"] for r in results]
    assert local[0]["probe/forecast_chunks"] > 0 and local[1]["probe/forecast_chunks"] == 0  # the case at hand
    assert [len(r["logged"]) for r in results] == [1, 1]
    assert set(results[0]["logged"][0][0]) == set(results[1]["logged"][0][0])  # what a DDP collective needs
    for r in results:  # the documented keys, the pooled values, no second averaging
        [(metrics, kw)] = r["logged"]
        assert set(metrics) == set(KEYS) and kw["sync_dist"] is True and kw["reduce_fx"] == "max"  # max of equal values
    pooled = results[0]["logged"][0][0]
    assert results[1]["logged"][0][0] == pooled
    assert pooled == pytest.approx(results[0]["all"], rel=1e-6)  # = one process over both ranks' episodes
    for count in ("probe/forecast_chunks", "probe/obs_tokens", "probe/forecast_tokens", "probe/forecast_actions"):
        assert pooled[count] == local[0][count] + local[1][count]
    means = {k: (local[0][k] + local[1][k]) / 2 for k in ("probe/obs_nll",)}  # 322 vs 29 observation tokens
    assert all(abs(pooled[k] - means[k]) > 1e-3 for k in means), (pooled, local)  # what sync_dist would log
