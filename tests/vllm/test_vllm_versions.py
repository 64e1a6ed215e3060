"""Several policy versions served at once by a real vLLM server on CPU (overlapped rollouts, ``data.max_lag >= 1``).

One managed server for the module, started for ``max_lag=2`` (``max_loras=2``, ``--max-cpu-loras 4``). The
versions tests prove: a held old version keeps sampling the old weights while the newest samples the new ones
(sampler log-probs against the trainer's own at each weight set), a released one is unloaded with its folder;
a collection thread on an old version runs while the main thread validates and syncs; a sync whose folder holds
other weights fails its delivery check; after a restart every held version is served again from its folder; branched
trees queued under an old version grow in the background on its adapter."""
from __future__ import annotations

import shutil
import threading

import pytest
import torch
from vllm_fixtures import SERVER_KW, lora_b, maze6

from cope.batch import collate
from cope.envs.base import Task
from cope.rollout.engine import EnvRuntime, Sampling
from cope.rollout.vllm.server import VLLMError
from cope.train.logprobs import sampler_gap, token_logprobs

pytestmark = pytest.mark.long  # one server start (35-65 s) for the module

TASKS = [Task("maze", "train", i // 2) for i in range(4)]  # 2 groups of 2
GROUPS = [i // 2 for i in range(4)]
SEEDED = Sampling(temperature=1.0, top_p=1.0, max_action_tokens=8, seed=7)


@pytest.fixture(scope="module")
def eng(vllm_python, served_policy, tmp_path_factory):
    from cope.rollout.vllm.engine import VLLMEngine

    e = VLLMEngine(maze6, EnvRuntime(), max_context=1024, workdir=str(tmp_path_factory.mktemp("vllm-versions")),
                   python=vllm_python, max_loras=2, **SERVER_KW)
    e.check_lag(2)
    e.connect(served_policy)
    yield e
    lora_b(served_policy, 0.0)
    e.shutdown()


def served(eng) -> dict[str, str]:
    """The server's adapters of this engine: name -> the folder it loads them from."""
    return {m["id"]: m["root"] for m in eng.client.get("/v1/models")["data"] if m.get("parent")}


def trainer_gap(policy, eps) -> float:
    """Mean |sampler log-prob - the trainer's log-prob| over the episodes' actions, at the trainer's current weights."""
    mb = collate(eps, policy.pad_id)
    with torch.no_grad():
        logits = policy.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                              position_ids=mb["position_ids"]).logits
    mb["old_logprobs"] = token_logprobs(logits, mb["input_ids"], with_entropy=False)[0]
    return sampler_gap([mb], eps)["rollout/logprob_gap"]


def test_check_lag_refuses_one_lora_slot_and_sizes_the_cache(eng):
    from cope.rollout.engine import HFEngine
    from cope.rollout.vllm.engine import VLLMEngine

    with pytest.raises(ValueError, match="data.engine.max_loras"):
        VLLMEngine(maze6, EnvRuntime(), max_context=1024, max_loras=1).check_lag(1)
    VLLMEngine(maze6, EnvRuntime(), max_context=1024, max_loras=1).check_lag(0)  # lag 0: as before
    HFEngine(maze6, EnvRuntime(), max_context=1024).check_lag(1)  # a sampler copy per held version: any lag
    assert eng.overlaps and HFEngine.overlaps
    i = eng.server.extra_args.index("--max-cpu-loras")
    assert eng.server.extra_args[i + 1] == "4"  # L+2 for max_lag=2


def test_two_versions_served_at_once_until_released(eng, served_policy):
    lora_b(served_policy, 0.0)
    eng.sync(10)
    eng.hold(10)
    lora_b(served_policy, 0.5)  # a trained-looking adapter: version 11
    eng.sync(11)
    names = served(eng)
    assert names[eng.versions.name(10)] == str(eng.versions.folder(10))  # each version from its own folder
    assert names[eng.versions.name(11)] == str(eng.versions.folder(11)) and eng.lora_name == eng.versions.name(11)
    old, st0 = eng.rollout(TASKS, GROUPS, SEEDED, version=10)
    new, st1 = eng.rollout(TASKS, GROUPS, SEEDED)  # the newest: 11
    assert st0.env_errors == st1.env_errors == 0
    assert [e.tokens for e in old] != [e.tokens for e in new]
    at_new = trainer_gap(served_policy, new), trainer_gap(served_policy, old)
    lora_b(served_policy, 0.0)  # back to version 10's weights
    at_old = trainer_gap(served_policy, old), trainer_gap(served_policy, new)
    print(f"gaps: new@new {at_new[0]:.2g} old@old {at_old[0]:.2g} old@new {at_new[1]:.2g} new@old {at_old[1]:.2g}")
    assert at_new[0] < 1e-4 and at_old[0] < 1e-4, (at_new, at_old)  # each version sampled its own weights
    assert at_new[1] > 1e-2 and at_old[1] > 1e-2, (at_new, at_old)  # and not the other's
    folder = eng.versions.folder(10)
    eng.release(10)
    assert eng.versions.name(10) not in served(eng) and not folder.exists()
    assert eng.versions.name(11) in served(eng) and eng.versions.folder(11).exists()
    with pytest.raises(ValueError, match="not loaded"):
        eng.hold(10)
    with pytest.raises(ValueError, match="not loaded"):
        eng.rollout(TASKS, GROUPS, SEEDED, version=10)


def test_collection_thread_on_an_old_version_while_the_main_thread_validates_and_syncs(eng, served_policy, monkeypatch):
    import cope.rollout.vllm.engine as engine_mod

    lora_b(served_policy, 0.3, seed=1)
    eng.sync(20)
    eng.hold(20)  # the queued collection's version
    lora_b(served_policy, 0.3, seed=2)
    eng.sync(21)
    named: dict[str, set] = {"collector": set(), "main": set()}
    slots: dict[str, int] = {}
    calls: list[str] = []
    main_started, synced = threading.Event(), threading.Event()
    real_complete, real_run = eng._complete, engine_mod.run_episodes
    out: dict = {}

    def who() -> str:
        return "collector" if threading.current_thread() is collector else "main"

    def spy_complete(requests):
        named[who()] |= {r["model"] for r in requests}
        calls.append(who())
        if who() == "collector" and calls.count("collector") == 1:  # its first turn waits for the validation to start
            assert main_started.wait(60), "the main thread's rollout never started"
        elif who() == "collector" and calls.count("collector") == 2:  # its second for the sync: mid-collection
            assert synced.wait(60), "the main thread never synced"
        return real_complete(requests)

    def spy_run(envs, *a, **k):
        slots[who()] = id(envs)
        if who() == "main":
            main_started.set()
        return real_run(envs, *a, **k)

    def collect():
        try:
            out["eps"] = eng.rollout(TASKS, GROUPS, SEEDED, version=20)
        except BaseException as e:  # noqa: B036 - handed to the main thread's assertion
            out["err"] = e

    monkeypatch.setattr(eng, "_complete", spy_complete)
    monkeypatch.setattr(engine_mod, "run_episodes", spy_run)
    collector = threading.Thread(target=collect, name="collector")
    try:
        collector.start()
        val, stats = eng.rollout(TASKS, GROUPS, Sampling(temperature=0.0, max_action_tokens=8))  # validation: the newest
        lora_b(served_policy, 0.3, seed=3)
        eng.sync(22)  # mid-collection: 21 goes (no hold), 20 stays (held)
        during = eng.versions.loaded
    finally:
        synced.set()
        main_started.set()
        collector.join(120)
    assert not collector.is_alive() and "err" not in out, out.get("err")
    eps, cstats = out["eps"]
    assert cstats.env_errors == stats.env_errors == 0 and len(eps) == len(val) == len(TASKS)
    assert named["collector"] == {eng.versions.name(20)} and named["main"] == {eng.versions.name(21)}, named
    assert slots["collector"] != slots["main"], "each concurrent rollout call has its own env slots"
    assert len(eng._envs._batches) >= 2 and calls.count("collector") >= 2, calls
    assert during == [20, 22], during
    assert eng.versions.loaded == [20, 22] and set(served(eng)) == {eng.versions.name(20), eng.versions.name(22)}
    eng.release(20)
    assert eng.versions.loaded == [22]


def test_undelivered_sync_fails_its_delivery_check(eng, served_policy, monkeypatch, tmp_path):
    lora_b(served_policy, 0.3, seed=4)
    eng.sync(30)
    stale = tmp_path / "stale"
    served_policy.model.save_pretrained(str(stale))  # version 30's weights
    lora_b(served_policy, 0.3, seed=5)  # version 31's
    checks = eng.stats()["delivery_checks"]
    monkeypatch.setattr(eng, "_save_adapter", lambda folder: shutil.copytree(stale, folder, dirs_exist_ok=True))
    with pytest.raises(VLLMError, match="not the trainer's version 31") as e:
        eng.sync(31)
    assert eng.versions.name(31) in str(e.value) and "\n" not in str(e.value)
    assert eng.versions.loaded == [30] and eng.versions.name(31) not in served(eng)  # the newest is still 30
    assert not eng.versions.folder(31).exists()
    monkeypatch.undo()
    eng.sync(31)  # delivered: passes
    print(f"delivery gap {eng.delivery_gap:.2g}, sync {eng.stats()['adapter_sync_seconds']:.3f} s")
    assert eng.delivery_gap < 1e-4 and eng.stats()["delivery_gap"] == eng.delivery_gap
    assert eng.stats()["delivery_checks"] == checks + 1  # the failed check is not counted as a delivery


def test_held_versions_are_loaded_again_from_their_folders(eng, served_policy):
    """What a restart does after the new server is up (the slow test below restarts a real one)."""
    eng.sync(40)
    eng.hold(40)
    lora_b(served_policy, 0.3, seed=6)
    eng.sync(41)
    for v in (40, 41):  # a server that lost its adapters
        eng.client.post("/v1/unload_lora_adapter", {"lora_name": eng.versions.name(v)})
    assert not {eng.versions.name(40), eng.versions.name(41)} & set(served(eng))
    eng.versions.reload()
    assert served(eng) == {eng.versions.name(v): str(eng.versions.folder(v)) for v in (40, 41)}
    eps, st = eng.rollout(TASKS, GROUPS, SEEDED, version=40)
    assert st.env_errors == 0
    eng.release(40)


def test_branched_trees_grow_in_the_background_on_the_held_adapter(eng, served_policy, monkeypatch):
    """+collector=branching with data.max_lag: epoch 1's trees, queued at the start of epoch 0 under version 60, grow in
    the collector thread on version 60's adapter after the trainer moved to 61: every request names it, and the
    sampler's log-probs are those of version 60's weights (not 61's)."""
    import random

    from cope.train.collect.branching.collector import BranchingCollector
    from cope.train.collect.collector import CollectorHost, TaskStream

    g, version, named = 4, [60], []
    tasks = [Task("maze", "train", t) for t in (30, 31) for _ in range(g)]
    real = eng._complete

    def spy(requests):
        named.append((threading.current_thread().name, {r["model"] for r in requests}))
        return real(requests)

    monkeypatch.setattr(eng, "_complete", spy)
    host = CollectorHost(engine=eng, sampling=Sampling(temperature=1.0, top_p=1.0, max_action_tokens=8),  # trainer_gap: T=1
                         task_stream=lambda epoch: TaskStream(tasks, [i // g for i in range(len(tasks))],
                                                              random.Random(epoch)),
                         rollout=None, version=lambda: version[0], max_epochs=lambda: 2, world=lambda: 1,
                         stopping=lambda: False, policy=lambda: served_policy)
    collector = BranchingCollector(host=host, group_size=g, roots=2, dedup=False, max_lag=2)
    try:
        lora_b(served_policy, 0.3, seed=8)
        collector.collect(0)  # queues epochs 0 and 1 under version 60
        lora_b(served_policy, 0.3, seed=9)
        version[0] = 61
        got = collector.collect(1)  # synced to 61; epoch 1's trees were queued under 60
    finally:
        collector.cancel()
    assert collector.off_policy and got.metrics["rollout/lag_mean"] == 1.0 and got.metrics["rollout/branch_forks"] > 0
    assert {n for thread, names in named if thread != "MainThread" for n in names} == {eng.versions.name(60)}
    assert all(s.sampler_logprobs is not None for e in got.episodes for s in e.steps)
    at_61 = trainer_gap(served_policy, got.episodes)
    lora_b(served_policy, 0.3, seed=8)
    at_60 = trainer_gap(served_policy, got.episodes)
    assert at_60 < 1e-3 < at_61, (at_60, at_61)
    assert eng.versions.loaded == [61]  # version 60 released once its collections were taken


@pytest.mark.slow
def test_killed_server_restarts_with_every_held_version(eng, served_policy):
    eng.sync(50)
    eng.hold(50)
    lora_b(served_policy, 0.3, seed=7)
    eng.sync(51)
    eng.server.kill()
    eng.rollout(TASKS, GROUPS, SEEDED, version=50)  # its first turn fails: restart, held versions loaded again
    assert eng.env_stats()["server_restarts"] == 1
    assert served(eng) == {eng.versions.name(v): str(eng.versions.folder(v)) for v in (50, 51)}
    eps, st = eng.rollout(TASKS, GROUPS, SEEDED, version=50)
    assert st.env_errors == 0 and not any(e.aborted for e in eps)
    eng.release(50)
    assert eng.versions.loaded == [51]
