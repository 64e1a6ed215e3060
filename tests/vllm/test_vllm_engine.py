"""The vLLM engine against a real server on CPU (default tier: one managed server shared by the module).

Token ids in and out, sampler log-probs equal to the trainer's in fp32, seeded reproducibility, the LoRA
hot-swap changing samples, the same greedy episodes as the in-process engine for the same weights, attach
by URL, and the connect-time checks failing in one line."""
from __future__ import annotations

import pytest
import torch
from vllm_fixtures import build_policy, lora_b, maze6

from cope.batch import collate
from cope.envs.base import Task
from cope.episode import Role
from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.rollout.vllm.server import VLLMError, free_port
from cope.train.logprobs import sampler_gap, token_logprobs

pytestmark = pytest.mark.long  # one server start (35-65 s) for the module

TASKS = [Task("maze", "train", i // 2) for i in range(8)]  # 4 groups of 2
GROUPS = [i // 2 for i in range(8)]
GREEDY = Sampling(temperature=0.0, top_p=1.0, max_action_tokens=8)


def sampled(seed: int) -> Sampling:
    return Sampling(temperature=1.0, top_p=1.0, max_action_tokens=8, seed=seed)


def test_connect_starts_a_local_server_and_loads_the_adapter(vllm_engine):
    eng = vllm_engine
    assert eng.server.managed and eng.server.url.startswith("http://127.0.0.1:")
    models = {m["id"]: m for m in eng.client.get("/v1/models")["data"]}
    assert eng.base_name == "base" and models[eng.lora_name]["parent"] == "base", models
    assert eng.stats()["server_start_seconds"] > 0
    assert eng.env_stats()["server_restarts"] == 0


def test_transcript_holds_exactly_the_returned_ids(vllm_engine, monkeypatch):
    eng, seen = vllm_engine, []
    real = eng.client.complete

    def spy(requests):  # records what the real server answered; changes nothing
        out = real(requests)
        seen.extend(zip(requests, out))
        return out

    monkeypatch.setattr(eng.client, "complete", spy)
    eng.sync(0)
    eps, stats = eng.rollout(TASKS, GROUPS, sampled(3))
    assert stats.env_errors == 0 and stats.generated_tokens > 0
    by_prompt: dict[tuple, list] = {}  # a group's first prompts are equal: a multiset of answers per prompt
    for req, out in seen:
        by_prompt.setdefault(tuple(req["prompt"]), []).append((req, out))
    steps = 0
    for ep in eps:
        for s in ep.steps:
            answers = by_prompt[tuple(ep.tokens[:s.action_start])]
            k = next(j for j, (_, out) in enumerate(answers) if out.ids == ep.tokens[s.action_start:s.action_end])
            req, out = answers.pop(k)  # the transcript holds these ids verbatim, nothing re-encoded
            assert s.sampler_logprobs == out.logprobs
            assert ep.roles[s.action_start:s.action_end] == [int(Role.ACTION)] * len(out.ids)
            assert s.closed == (out.ids[-1] in eng.policy.chat.stop_ids)
            assert req["stop_token_ids"] == list(eng.policy.chat.stop_ids) and req["logprobs"] == 1 and req["return_token_ids"]
            steps += 1
    assert steps == len(seen)
    seeds = [req["seed"] for req, _ in seen]
    assert len(set(seeds)) == len(seeds), "every request carries its own seed (never one seed for many prompts)"


def test_seeded_rollouts_repeat_and_seeds_differ(vllm_engine):
    a, _ = vllm_engine.rollout(TASKS, GROUPS, sampled(11))
    b, _ = vllm_engine.rollout(TASKS, GROUPS, sampled(11))
    c, _ = vllm_engine.rollout(TASKS, GROUPS, sampled(12))
    assert [e.tokens for e in a] == [e.tokens for e in b]
    assert [e.tokens for e in a] != [e.tokens for e in c]
    assert a[0].tokens != a[1].tokens  # same task, same call: the group's episodes differ


def test_branched_groups_grow_on_the_server(vllm_engine, served_policy, monkeypatch):
    """+collector=branching with rollout=vllm: each wave's requests go to the server, a child's first request is its
    parent's ids up to the fork (the server's prefix cache serves them), no request seed repeats over the waves (the
    actor is reused; its slot keys restart at 0 each wave), and the trees cost fewer env steps than the flat group."""
    import random

    from cope.train.collect.branching.collector import BranchingCollector
    from cope.train.collect.collector import CollectorHost, TaskStream

    eng, seen = vllm_engine, []
    real = eng.client.complete

    def spy(requests):
        seen.extend(requests)
        return real(requests)

    monkeypatch.setattr(eng.client, "complete", spy)
    g = 4
    tasks = [Task("maze", "train", t) for t in (20, 21) for _ in range(g)]
    host = CollectorHost(engine=eng, sampling=Sampling(temperature=0.7, top_p=1.0, max_action_tokens=8),
                         task_stream=lambda epoch: TaskStream(tasks, [i // g for i in range(len(tasks))], random.Random(5)),
                         rollout=None, version=lambda: 0, max_epochs=lambda: None, world=lambda: 1,
                         stopping=lambda: False, policy=lambda: served_policy)
    got = BranchingCollector(host=host, group_size=g, roots=2, dedup=False).collect(0)
    eps, m = got.episodes, got.metrics
    assert len(eps) == 2 * g and m["rollout/branch_forks"] > 0 and m["rollout/branch_replay_mismatch"] == 0
    assert m["rollout/branch_env_steps"] < m["rollout/branch_flat_env_steps_est"]
    prompts = [tuple(r["prompt"]) for r in seen]
    for e in eps:
        if e.branch_of >= 0:
            parent = eps[e.branch_of]
            fork = e.steps[e.shared_steps]  # the child's first own action: sampled from its parent's prefix
            assert tuple(e.tokens[:fork.action_start]) in prompts
            assert e.tokens[:parent.steps[e.shared_steps - 1].obs_end] == parent.tokens[:parent.steps[e.shared_steps - 1].obs_end]
        assert all(s.sampler_logprobs is not None and len(s.sampler_logprobs) == s.action_end - s.action_start
                   for s in e.steps)
    seeds = [r["seed"] for r in seen]
    assert len(set(seeds)) == len(seeds), "a request seed was sent twice (the waves' slot keys restart at 0)"


def test_sampler_logprobs_match_the_trainers_fp32(vllm_engine, served_policy):
    eps, _ = vllm_engine.rollout(TASKS, GROUPS, sampled(5))
    mb = collate(eps, served_policy.pad_id)
    with torch.no_grad():
        logits = served_policy.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                     position_ids=mb["position_ids"]).logits
    mb["old_logprobs"] = token_logprobs(logits, mb["input_ids"], with_entropy=False)[0]
    gap = sampler_gap([mb], eps)
    assert gap["rollout/logprob_gap"] < 1e-4 and gap["rollout/logprob_gap_max"] < 1e-3, gap


def test_sync_changes_samples_and_matches_hf_greedy(vllm_engine, served_policy):
    eng = vllm_engine
    hf = HFEngine(maze6, EnvRuntime(), max_context=1024)
    hf.connect(served_policy)
    try:
        eng.sync(0)
        before, _ = eng.rollout(TASKS, GROUPS, GREEDY)
        assert [e.tokens for e in before] == [e.tokens for e in hf.rollout(TASKS, GROUPS, GREEDY)[0]]
        lora_b(served_policy, 0.5)  # a trained-looking adapter
        n = len(eng.sync_seconds)
        eng.sync(1)
        assert len(eng.sync_seconds) == n + 1 and eng.stats()["adapter_sync_seconds"] < 30
        after, _ = eng.rollout(TASKS, GROUPS, GREEDY)
        assert [e.tokens for e in after] != [e.tokens for e in before], "the new adapter must change the server's samples"
        assert [e.tokens for e in after] == [e.tokens for e in hf.rollout(TASKS, GROUPS, GREEDY)[0]]
        eng.sync(1)  # same version: nothing to do
        assert len(eng.sync_seconds) == n + 1
    finally:
        lora_b(served_policy, 0.0)
        eng.sync(2)
        hf.close()


def test_attach_by_url(vllm_engine, served_policy, monkeypatch, tmp_path):
    from cope.rollout.vllm.engine import VLLMEngine

    monkeypatch.setenv("RANK", "0")  # ignored: the rank comes from the trainer (here: connect's argument)
    att = VLLMEngine(maze6, EnvRuntime(), max_context=1024, url=vllm_engine.server.url, workdir=str(tmp_path))
    att.connect(served_policy, rank=1)  # a second trainer rank: its own adapter name and folder
    assert not att.server.managed and att.lora_name == "cope-rank1-v0" and att.base_name == "base"
    assert att.adapter_dir.name == "adapter-rank1-v0"  # one folder per version
    mine, _ = att.rollout(TASKS, GROUPS, GREEDY)
    theirs, _ = vllm_engine.rollout(TASKS, GROUPS, GREEDY)
    assert [e.tokens for e in mine] == [e.tokens for e in theirs]
    att.shutdown()  # ends nothing: the server is not the attached engine's
    assert vllm_engine.server.alive()


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_unreachable_url_is_a_one_line_error(served_policy, tmp_path):
    from cope.rollout.vllm.engine import VLLMEngine

    url = f"http://127.0.0.1:{free_port()}"
    eng = VLLMEngine(maze6, EnvRuntime(), max_context=1024, url=url, workdir=str(tmp_path), startup_timeout_s=2)
    with pytest.raises(VLLMError) as e:
        eng.connect(served_policy)
    assert url in _one_line(e)


@pytest.mark.parametrize("case", ["tokenizer", "weights", "adapter", "context"])
def test_mismatch_is_a_one_line_error_before_training(case, vllm_engine, served_policy, cope_cache, monkeypatch, tmp_path):
    from cope.models.policy import load_pretrained
    from cope.rollout.vllm.engine import VLLMEngine

    monkeypatch.setenv("RANK", "2")
    max_context = 1024
    if case == "tokenizer":  # another tiny model: another tokenizer
        policy, want = build_policy(cope_cache, vocab_size=300), "tokenizer mismatch"
    elif case == "weights":  # the same tokenizer, other base weights
        policy, want = load_pretrained(served_policy.source, lora=served_policy.model.peft_config["default"], dtype="fp32"), \
            "model mismatch"
        with torch.no_grad():
            policy.model.get_base_model().model.embed_tokens.weight.mul_(3.0)
    elif case == "adapter":  # rank 32 > the server's max LoRA rank (8)
        policy, want = build_policy(cope_cache, r=32), "did not load the adapter"
    else:
        policy, want, max_context = served_policy, "max_model_len", 4096
    eng = VLLMEngine(maze6, EnvRuntime(), max_context=max_context, url=vllm_engine.server.url, workdir=str(tmp_path))
    with pytest.raises(VLLMError) as e:
        eng.connect(policy)
    assert want in _one_line(e)
    assert vllm_engine.server.alive()
