"""RWML (cope.algos.rwml): triplets, the world-model prompt, the rewards at their thresholds, the too-easy filter, the
collector's world-model episodes (through the unchanged GRPO objectives), the engines' ``complete``, the config's
errors, and the stage switch and resume of ``algo=rwml_grpo`` (a resume inside either stage equals the straight run)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import random
from types import SimpleNamespace

import pytest
import torch
from conftest import metric_rows  # at import: tests/vllm/conftest.py takes the name `conftest` once collected
from tiny_fixtures import tiny_chat, tiny_policy, tiny_tokenizer

from cope.algos.grpo import KLPenalty, PolicyGradient
from cope.algos.rwml.collector import METRICS, RWMLCollector
from cope.algos.rwml.easy_filter import keep_triplets
from cope.algos.rwml.embedders import HashedNgramEmbedder, SentenceTransformerEmbedder
from cope.algos.rwml.prompt import DEFAULT_INSTRUCTION, WorldModelPrompt, prompt_ids
from cope.algos.rwml.rewards import EmbeddingCosine, ExactMatch, RougeL, rouge_l_f1
from cope.algos.rwml.triplets import Triplet, extract_triplets, previous_observation
from cope.algos.rwml.world import engine_completes
from cope.batch import collate
from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.episode import Role
from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.rollout.loop import RolloutStats, Sampled, _encode, run_episodes
from cope.train.collect.collector import CollectorHost, TaskStream
from cope.train.collect.experience import assign_advantages
from cope.train.collect.lagged import LaggedCollector
from cope.train.objectives import ForwardOut

MAZE = functools.partial(MazeEnv, sizes=[6], max_steps=5)
TASK = Task("maze", "train", 0)


# -- a scripted maze episode (shared with tests/test_wm_sft.py) ---------------------------------------------------------
def _wall(admissible: list[str]) -> str:
    return next(d for d in ("north", "south", "east", "west") if d not in admissible)


# per step: the action's text from the admissible moves, and whether the policy sampled the stop id
PLAN = [(lambda adm: adm[0], True), (lambda adm: "xyz", True), (lambda adm: _wall(adm), False),
        (lambda adm: adm[0], True), (lambda adm: adm[-1], True)]


class ScriptActor:
    """Plays :data:`PLAN`: valid, malformed (no observation), a wall (invalid, observed; the action hits its cap), valid."""

    def __init__(self, tok, chat):
        self.tok, self.chat, self.turn, self.texts = tok, chat, 0, []

    def __call__(self, contexts, admissible, keys):
        text, closed = PLAN[self.turn][0](admissible[0]), PLAN[self.turn][1]
        self.turn += 1
        self.texts.append(text)
        return [list(self.tok.encode(text, add_special_tokens=False)) + ([self.chat.stop_id] if closed else [])]


def scripted_episodes():
    """One scripted maze episode (the real rollout loop), the action texts it played, the tokenizer and the chat."""
    tok, chat = tiny_tokenizer(), tiny_chat()
    actor = ScriptActor(tok, chat)
    eps, _ = run_episodes([MAZE()], [TASK], [0], actor, tok, chat, max_context=2048, max_action_tokens=16)
    return eps, actor.texts, tok, chat


@pytest.fixture(scope="module")
def scripted():
    return scripted_episodes()


def test_triplets_of_a_maze_episode_equal_the_hand_built_list(scripted):
    (ep,), texts, tok, chat = scripted
    env = MAZE()
    first = env.reset(TASK)
    pos = len([*chat.system_open, *_encode(tok, env.instructions), *chat.turn_end, *chat.newline, *chat.user_open,
               *_encode(tok, first.observation), *chat.close_turn()])
    want = []
    for t, (text, (_, closed)) in enumerate(zip(texts, PLAN)):
        res = env.step(text)
        end = pos + len(tok.encode(text, add_special_tokens=False)) + int(closed)  # the action, its sampled stop id
        opening = [*([] if closed else chat.turn_end), *chat.newline, *chat.user_open]
        obs = _encode(tok, res.observation)
        harness = _encode(tok, ("\n" if res.observation else "") + res.harness) if res.harness else []
        if obs:  # the malformed action's feedback is harness text only: no triplet
            want.append(Triplet(0, t, end, end + len(opening), tuple(obs), res.valid))
        pos = end + len(opening) + len(obs) + len(harness) + len(chat.turn_end if res.done else chat.close_turn())
    assert [w.valid for w in want] == [True, False, True, True] and len(ep.steps) == 5
    assert extract_triplets([ep], chat) == want
    assert extract_triplets([ep], chat, skip_invalid=True) == [w for w in want if w.valid]
    assert tok.decode(list(want[1].observation)).startswith("Wall.")  # the env's answer, no harness text
    was, ep.end_reason = ep.end_reason, "aborted"
    try:
        assert extract_triplets([ep], chat) == []
    finally:
        ep.end_reason = was


def test_the_previous_observation_is_what_the_agent_saw_before_each_action(scripted):
    """For RWML's copy diagnostic: the first observation before a_0, then each step's observation (none after the
    malformed action, whose feedback is harness text only)."""
    (ep,), texts, tok, chat = scripted
    env = MAZE()
    seen = [env.reset(TASK).observation]
    seen += [env.step(text).observation for text in texts[:-1]]
    want = [tuple(_encode(tok, o)) if o else () for o in seen]
    assert [previous_observation(ep, t) for t in range(len(ep.steps))] == want
    assert want[2] == () and all(want[t] for t in (0, 1, 3, 4))


def test_the_prompt_continues_the_transcript_token_exactly(scripted):
    (ep,), _, tok, chat = scripted
    prompt = WorldModelPrompt(tok)
    for tr in extract_triplets([ep], chat):
        ids = prompt_ids(ep, tr, chat, prompt)
        s = ep.steps[tr.step]
        assert ids == [*ep.tokens[: s.action_end], *chat.after_action(s.closed), *tok.encode(DEFAULT_INSTRUCTION),
                       *chat.close_turn()]
        text = tok.decode(ids[tr.anchor:])
        assert text == f"{DEFAULT_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n", text


@pytest.mark.parametrize("family", ["chatml-hermes", "llama3.1", "mistral"])
def test_native_tool_calls_give_triplets_whose_target_is_the_tool_result(family):
    """env.action_format=native: the answer to a call sits in the template's tool-result turn (Llama 3.1's ipython,
    Mistral's [TOOL_RESULTS]), not a user turn: the triplet's target is still the tool result's observation ids, and
    the world-model question follows a_t as the user turn a text action gets (Triplet.opening)."""
    from tool_templates import GOOD_SCRIPT, family_tokenizer, run_tool_episodes

    from cope.algos.rwml.prompt import sft_sample
    from cope.chat import ChatFormat

    tok = family_tokenizer(family)
    chat = ChatFormat.from_template(tok)
    eps, envs, _ = run_tool_episodes(tok, chat, [GOOD_SCRIPT])
    (ep,), prompt = eps, WorldModelPrompt(tok)
    triplets = extract_triplets(eps, chat)
    assert [tr.step for tr in triplets] == list(range(len(ep.steps))) == [0, 1, 2]
    for tr, (obs, _h) in zip(triplets, envs[0].turns[1:]):
        s = ep.steps[tr.step]
        assert tok.decode(list(tr.observation)) == obs  # the tool's answer, and only it
        assert tr.history_end == s.action_end and tr.anchor == s.action_end + (0 if tr.opening else len(chat.after_action(s.closed)))
        ids = prompt_ids(ep, tr, chat, prompt)
        assert ids == [*ep.tokens[: s.action_end], *chat.after_action(s.closed), *prompt.ids, *chat.close_turn()]
        sample = sft_sample(tr, chat, prompt)
        whole = ep.tokens[: sample.anchor] + sample.tokens
        assert whole[: len(ids)] == ids and [t for t, m in zip(sample.tokens, sample.target) if m] == [
            *tr.observation, *chat.turn_end]
    assert any(tr.opening for tr in triplets) == (family != "chatml-hermes")  # hermes answers calls in a user turn


# -- rewards ------------------------------------------------------------------------------------------------------------
def test_embedding_reward_at_its_threshold():
    vectors = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 0.0]}
    stub = lambda texts: torch.tensor([vectors[t] for t in texts])  # noqa: E731 - a pure map, distance 1 between a, b
    assert EmbeddingCosine(stub, tau_d=1.0)(["a", "a"], ["b", "c"]) == [0.0, 1.0]  # d = 1 is not < 1
    assert EmbeddingCosine(stub, tau_d=math.nextafter(1.0, 2.0))(["a"], ["b"]) == [1.0]
    assert EmbeddingCosine(stub, tau_d=1e-9)(["a"], ["c"]) == [1.0]  # identical rows: d = 0
    hashed = EmbeddingCosine(HashedNgramEmbedder(), tau_d=0.2)
    obs = "Goal: 2 south, 1 east. Closer: south. Open: north, south, west."
    assert hashed([obs, "  " + obs.replace(" ", "\n  "), "You reached the goal."], [obs] * 3) == [1.0, 1.0, 0.0]
    assert torch.equal(HashedNgramEmbedder()([obs]), HashedNgramEmbedder()([obs]))  # no state, no salted hash
    d = hashed.distances(["Wall. " + obs], [obs]).item()
    assert EmbeddingCosine(HashedNgramEmbedder(), tau_d=d)(["Wall. " + obs], [obs]) == [0.0]
    assert EmbeddingCosine(HashedNgramEmbedder(), tau_d=math.nextafter(d, 2.0))(["Wall. " + obs], [obs]) == [1.0]


def test_rouge_l_and_exact_match_at_their_thresholds():
    assert rouge_l_f1("a b c d", "a b x y") == 0.5
    assert RougeL(threshold=0.5)(["a b c d"], ["a b x y"]) == [1.0]
    assert RougeL(threshold=math.nextafter(0.5, 1.0))(["a b c d"], ["a b x y"]) == [0.0]
    assert RougeL(threshold=1.0)(["a b", ""], ["a b", "x"]) == [1.0, 0.0]
    assert ExactMatch()(["  Wall.\n Goal:  2 south ", "wall. Goal: 2 south", "Wall. Goal: 2 south."],
                        ["Wall. Goal: 2 south"] * 3) == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("tau_d", [0.0, 2.0, -0.1, 2.5])
def test_tau_d_outside_its_range_names_the_key(tau_d):
    with pytest.raises(ValueError, match=r"rwml\.reward\.tau_d must be in \(0, 2\)"):
        EmbeddingCosine(tau_d=tau_d)


def test_tau_d_of_one_or_more_warns_that_an_empty_prediction_passes(caplog):
    """At tau_d >= 1 an empty prediction (all-zero embedding: distance exactly 1) or unrelated text scores 1."""
    with caplog.at_level("WARNING", logger="cope.algos.rwml.rewards"):
        assert EmbeddingCosine(tau_d=1.05)(["", "I am a banana"], ["Goal: 2 south. Open: north, south."] * 2) == [1.0, 1.0]
    assert "rwml.reward.tau_d=1.05" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="cope.algos.rwml.rewards"):
        assert EmbeddingCosine(tau_d=0.99)([""], ["Goal: 2 south."]) == [0.0]
    assert caplog.text == ""


def test_sentence_transformer_embedder_names_the_path_and_the_extra(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=rf"rwml\.reward\.embedder\.path = '{missing}': no such folder"):
        SentenceTransformerEmbedder(str(missing))
    with pytest.MonkeyPatch.context() as mp:  # the extra missing (it is installed by `make install`)
        mp.setattr("cope.extras.available", lambda module: module != "sentence_transformers")
        with pytest.raises(ImportError, match=r"cope-trainer\[rwml\]"):
            SentenceTransformerEmbedder(str(tmp_path))


def test_sentence_transformer_embedder_on_a_local_model(tmp_path):
    """The GPU machines' embedder, end to end on a tiny BERT saved locally (built from config, nothing downloaded):
    unit-norm embeddings, the same text at cosine 1, and the reward it feeds at its threshold."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "you", "see", "a", "wall", "door", "north", "is", "open"]
    bert = tmp_path / "bert"
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(bert)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(bert)
    body = models.Transformer(str(bert))
    SentenceTransformer(modules=[body, models.Pooling(body.get_word_embedding_dimension())]).save(str(tmp_path / "st"))
    embed = SentenceTransformerEmbedder(str(tmp_path / "st"), device="cpu")
    e = embed(["you see a wall", "you see a wall", "the door is open"])  # (3, 16)
    assert e.shape == (3, 16) and torch.allclose(e.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert float(e[0] @ e[1]) == pytest.approx(1.0, abs=1e-5) and float(e[0] @ e[2]) < 1.0 - 1e-4  # another text
    far = 1.0 - float(e[0] @ e[2])  # the cosine distance of the two texts: the reward's threshold either side of it
    assert EmbeddingCosine(embedder=embed, tau_d=far * 1.01)(["you see a wall"], ["the door is open"]) == [1.0]
    assert EmbeddingCosine(embedder=embed, tau_d=far * 0.99)(["you see a wall"], ["the door is open"]) == [0.0]


def test_the_config_refuses_tau_d_and_a_missing_embedder_path(compose, tmp_path):
    from hydra.errors import InstantiationException

    from cope.run.config_check import check_config
    from cope.run.train import build

    for algo in ("algo=rwml", "algo=rwml_grpo", "algo=wm_sft"):
        check_config(compose([algo], tmp_path))  # every key read, every value typed
    env = build(compose(["algo=rwml"], tmp_path).env, "env")
    with pytest.raises(InstantiationException, match=r"rwml\.reward\.tau_d must be in \(0, 2\) .*, got 2\.5"):
        build(compose(["algo=rwml", "rwml.reward.tau_d=2.5"], tmp_path).data, "data", env=env)
    st = ["~rwml.reward.embedder", "+rwml.reward.embedder={_target_: cope.algos.rwml.embedders.SentenceTransformerEmbedder, "
          f"path: {tmp_path / 'missing'}}}"]  # the documented swap of the embedder (conf/algo/rwml.yaml)
    cfg = compose(["algo=rwml", *st], tmp_path)
    check_config(cfg)
    with pytest.raises(InstantiationException, match=r"rwml\.reward\.embedder\.path = .*missing': no such folder"):
        build(cfg.data, "data", env=env)


# -- the too-easy filter ------------------------------------------------------------------------------------------------
def test_the_too_easy_filter_keeps_a_tenth_of_the_all_correct_triplets():
    rng = random.Random(0)
    kept = keep_triplets([[1.0] * 4] * 20000, 0.1, rng)
    assert 0.09 < sum(kept) / len(kept) < 0.11  # binomial sd 0.002
    mixed = [[1.0, 0.0, 1.0, 1.0], [0.0] * 4, [1.0, 1.0, 1.0, 0.0]] * 1000
    assert all(keep_triplets(mixed, 0.1, rng))  # none dropped when not all correct
    assert keep_triplets([[1.0] * 4] * 50, 0.1, random.Random(7)) == keep_triplets([[1.0] * 4] * 50, 0.1, random.Random(7))
    with pytest.raises(ValueError, match=r"rwml\.easy_keep"):
        keep_triplets([], 1.5, rng)


# -- the collector on a fake engine -------------------------------------------------------------------------------------
class FakeEngine:
    """Completes a world-model prompt with its triplet's true observation where ``right(k, j)`` (k: the triplet's rank
    by prompt, j: the sample), else with "xyz"."""

    completes = True

    def __init__(self, policy, truth, right):
        self.policy, self.truth, self.right, self.calls = policy, truth, right, []

    def complete(self, contexts, sampling, n=1, batch_size=None):
        self.calls.append((contexts, sampling, n))
        tok, stop = self.policy.tokenizer, self.policy.chat.stop_id
        wrong = list(tok.encode("xyz", add_special_tokens=False))
        return [[Sampled((list(self.truth[tuple(c)]) if self.right(self.rank(c), j) else wrong) + [stop])
                 for j in range(n)] for c in contexts]

    def rank(self, context):
        return sorted(self.truth).index(tuple(context))


def _host(episodes, engine, world=1):
    tasks, groups = [e.task for e in episodes], [e.group for e in episodes]

    def rollout(tasks, groups, seed):
        return copy.deepcopy(episodes), RolloutStats(episodes=len(episodes), env_steps=5, generated_tokens=9)

    return CollectorHost(engine=engine, sampling=Sampling(max_action_tokens=4), rollout=rollout, version=lambda: 0,
                         task_stream=lambda epoch: TaskStream(tasks, groups, random.Random(epoch)),
                         max_epochs=lambda: None, world=lambda: world, stopping=lambda: False,
                         policy=lambda: getattr(engine, "policy", None))


def _collector(scripted, right, **kw):
    (ep,), _, tok, chat = scripted
    policy = SimpleNamespace(tokenizer=tok, chat=chat)
    truth = {tuple(prompt_ids(ep, tr, chat, WorldModelPrompt(tok))): tr.observation for tr in extract_triplets([ep], chat)}
    engine = FakeEngine(policy, truth, right)
    args = dict(reward=ExactMatch(), predictions=4, max_triplets=8, max_prediction_tokens=32) | kw
    return RWMLCollector(host=_host([ep], engine), **args), engine


def test_world_model_episodes_are_one_group_per_triplet(scripted):
    (ep,), _, tok, chat = scripted
    col, engine = _collector(scripted, lambda k, j: j % 2 == 0, easy_keep=0.0)  # two right, two wrong per triplet
    got = col.collect(3)
    (contexts, sampling, n), = engine.calls
    assert n == 4 and len(contexts) == 4 and sampling.max_action_tokens == 32 and sampling.temperature == 1.0
    assert len(got.episodes) == 16 and got.groups == [g for g in range(4) for _ in range(4)]
    for e, g in zip(got.episodes, got.groups):
        P = e.prompt_len
        assert e.group == g and e.task == TASK and e.sampled_epoch == 3 and len(e.steps) == 1
        assert e.roles == [Role.PROMPT] * P + [Role.ACTION] * (len(e.tokens) - P)
        assert e.tokens[:P] == contexts[g] and (e.steps[0].action_start, e.steps[0].action_end) == (P, len(e.tokens))
        assert e.reward == e.steps[0].reward == float(e.success)
    assert [e.reward for e in got.episodes[:4]] == [1.0, 0.0, 1.0, 0.0]
    assert set(got.metrics) >= set(METRICS) and got.metrics["rwml/reward"] == 0.5
    assert got.metrics["rwml/pass_rate"] == 1.0 and got.metrics["rwml/all_correct"] == 0.0
    assert got.metrics["rwml/copy_reward"] == 0.0  # no maze observation here repeats the one before it exactly
    assert got.metrics["rwml/kept"] == 4 and got.metrics["rwml/easy_dropped"] == 0  # easy_keep=0 drops no mixed group
    assert got.stats.episodes == 1 and got.stats.generated_tokens > 9  # env episodes; the predictions' tokens added
    again, _ = _collector(scripted, lambda k, j: j % 2 == 0, easy_keep=0.0)
    assert [e.tokens for e in again.collect(3).episodes] == [e.tokens for e in got.episodes]  # deterministic


@pytest.mark.parametrize("threshold", [0.5, 0.8])
def test_the_copy_diagnostic_scores_the_previous_observation_with_the_runs_reward(scripted, threshold):
    """``rwml/copy_reward``: the run's reward given the observation before a_t as the prediction, on the triplets
    scored, by hand with ROUGE-L (consecutive maze observations share most words: a loose threshold pays a copy)."""
    (ep,), _, tok, chat = scripted
    col, _ = _collector(scripted, lambda k, j: j == 0, reward=RougeL(threshold))
    got = col.collect(0)
    dec = functools.partial(tok.decode, skip_special_tokens=True)
    want = [float(rouge_l_f1(dec(list(previous_observation(ep, tr.step))), dec(list(tr.observation))) >= threshold)
            for tr in extract_triplets([ep], chat)]
    assert got.metrics["rwml/copy_reward"] == pytest.approx(sum(want) / len(want))
    assert (0 < sum(want) < len(want)) if threshold == 0.5 else sum(want) == 0, want


def test_all_correct_triplets_are_dropped_by_the_filter_and_an_empty_epoch_trains_placeholders(scripted):
    col, _ = _collector(scripted, lambda k, j: k < 2, easy_keep=0.0)  # triplets 0, 1 always right
    got = col.collect(0)
    assert got.metrics["rwml/easy_dropped"] == 2 and got.metrics["rwml/kept"] == 2 and len(got.episodes) == 8
    assert all(e.reward == 0.0 for e in got.episodes)
    col, _ = _collector(scripted, lambda k, j: True, easy_keep=0.0)
    got = col.collect(0)
    assert got.metrics["rwml/placeholder"] == 1.0 and got.metrics["rwml/kept"] == 0
    (ep,), *_ = scripted
    assert [e.tokens for e in got.episodes] == [ep.tokens] and got.episodes[0].reward == 0.0  # no advantage, no task reward
    col, _ = _collector(scripted, lambda k, j: True, easy_keep=1.0, max_triplets=3)
    got = col.collect(0)
    assert got.metrics["rwml/scored"] == 3 and got.metrics["rwml/kept"] == 3 and got.metrics["rwml/all_correct"] == 1.0


def _other_rank(monkeypatch, kept: int):
    """reduce_over_world as on 2 ranks whose other one kept ``kept`` groups (and sampled as many predictions)."""
    def reduce(values, op, world):
        assert world == 2 and op in ("max", "sum"), op
        return [max(values[0], float(kept))] if op == "max" else [values[0] + float(kept * 4)]
    monkeypatch.setattr("cope.algos.rwml.collector.reduce_over_world", reduce)


def _two_ranks(scripted, right, monkeypatch, other: int, **kw):
    col, engine = _collector(scripted, right, **kw)
    col.host = dataclasses.replace(col.host, world=lambda: 2)
    _other_rank(monkeypatch, other)
    return col, engine


def test_under_ddp_each_rank_trains_all_it_kept_and_takes_the_fullest_ranks_steps(scripted, monkeypatch):
    """A rank never drops a kept group because another rank kept fewer: it trains all of them, and every rank takes
    the optimizer steps of the rank that kept the most (Collected.nominal); a rank that kept none trains one idle row
    in each of those steps, and only when no rank kept one does the epoch fall back to the placeholders."""
    from cope.train.collect.experience import cut_minibatches

    col, _ = _two_ranks(scripted, lambda k, j: j % 2 == 0, monkeypatch, other=1, easy_keep=0.0)
    got = col.collect(0)  # this rank 4 groups, the other 1: none dropped here
    assert got.metrics["rwml/kept"] == 4 and len(got.episodes) == 16 and got.nominal == 16
    col, _ = _two_ranks(scripted, lambda k, j: j % 2 == 0, monkeypatch, other=6, easy_keep=0.0)
    got = col.collect(0)
    assert len(got.episodes) == 16 and got.nominal == 24 and got.metrics["rwml/placeholder"] == 0.0
    assert len(cut_minibatches(got.episodes, 8, 0, random.Random(0), count=-(-got.nominal // 8))) == 3
    col, engine = _two_ranks(scripted, lambda k, j: True, monkeypatch, other=2, easy_keep=0.0)  # all dropped here
    got = col.collect(0)
    (idle,) = got.episodes
    assert idle.aborted and idle.skipped and not idle.failed and not idle.steps  # trains nothing, fails nothing
    assert got.nominal == 8 and got.metrics["rwml/placeholder"] == 0.0
    (ep,), *_ = scripted
    assert idle.tokens == ep.tokens[: ep.prompt_len]
    mbs = cut_minibatches(got.episodes, 8, 0, random.Random(0), count=1)
    assert len(mbs) == 1 and not mbs[0]["action_mask"].any()  # a forward with nothing to train
    col, _ = _two_ranks(scripted, lambda k, j: True, monkeypatch, other=0, easy_keep=0.0)
    got = col.collect(0)
    assert got.metrics["rwml/placeholder"] == 1.0 and got.nominal is None and [e.tokens for e in got.episodes] == [ep.tokens]


def test_a_rank_without_a_triplet_still_enters_the_engines_completion(scripted):
    """engine.complete is called on every rank, with no context too: under trainer=fsdp it gathers the weights, a
    collective every rank must enter (a rank skipping it would hang the others)."""
    col, engine = _collector(scripted, lambda k, j: True, max_prediction_tokens=32, max_context=40)
    got = col.collect(0)
    (contexts, _, n), = engine.calls
    assert contexts == [] and n == 4 and got.metrics["rwml/dropped_long"] == 4 and got.metrics["rwml/placeholder"] == 1.0


def test_a_blank_prompt_or_a_prediction_cap_beyond_the_context_fails_at_build(scripted):
    with pytest.raises(ValueError, match=r"rwml\.prompt is empty"):
        _collector(scripted, lambda k, j: True, prompt="  ")
    with pytest.raises(ValueError, match=r"rwml\.max_prediction_tokens=64 leaves no room .* data\.max_context=64"):
        _collector(scripted, lambda k, j: True, max_prediction_tokens=64, max_context=64)


def test_the_stage_switch_and_the_collector_state(scripted):
    (ep,), *_ = scripted
    col, engine = _collector(scripted, lambda k, j: j == 0, epochs=1)
    first, second = col.collect(0), col.collect(1)
    assert first.metrics["rwml/stage"] == 1.0 and second.metrics["rwml/stage"] == 0.0 and len(engine.calls) == 1
    assert [e.tokens for e in second.episodes] == [ep.tokens] and second.groups == [0]  # the task episodes as they came
    assert set(first.metrics) == set(second.metrics)  # the same keys in both stages
    assert col.state_dict() == {"rwml_predictions": 16}
    fresh, _ = _collector(scripted, lambda k, j: j == 0, epochs=1)
    fresh.load_state_dict({"counters": {}, **col.state_dict()})
    assert fresh.predictions_total == 16 and fresh.collect(1).metrics["rwml/predictions_total"] == 16.0


def test_world_model_episodes_through_grpo_give_the_hand_computed_loss(scripted):
    col, _ = _collector(scripted, lambda k, j: (k + j) % 3 == 0, easy_keep=1.0, max_triplets=2)
    got = col.collect(0)
    eps = got.episodes
    assign_advantages(eps, got.groups, "grpo")
    mb = collate(eps, 0)
    N, T = mb["input_ids"].shape
    g = torch.Generator().manual_seed(0)
    lp, old, ref = (-torch.rand(N, T, generator=g) * 3 for _ in range(3))
    mb["old_logprobs"] = old
    out = ForwardOut(logprobs=lp, entropy=torch.zeros(N, T), ref_logprobs=ref)
    pg, _ = PolicyGradient()(out, mb)
    kl, _ = KLPenalty(weight=0.1)(out, mb)
    rows, kls = [], []  # by hand: GRPO advantages from the 0/1 rewards, clipped ratio, per-episode token mean, k3 KL
    for i, e in enumerate(eps):
        mates = [x.reward for x in eps if x.group == e.group]
        mean = sum(mates) / len(mates)
        adv = (e.reward - mean) / (math.sqrt(sum((r - mean) ** 2 for r in mates) / len(mates)) + 1e-6)
        toks = range(e.steps[0].action_start, e.steps[0].action_end)
        terms = []
        for t in toks:
            ratio = math.exp(lp[i, t] - old[i, t])
            terms.append(-min(ratio * adv, min(max(ratio, 0.8), 1.2) * adv))
            d = float(ref[i, t] - lp[i, t])
            kls.append(math.exp(d) - d - 1)
        rows.append(sum(terms) / len(terms))
    assert {e.reward for e in eps} == {0.0, 1.0}
    assert pg.item() == pytest.approx(sum(rows) / len(rows), rel=1e-5)
    assert kl.item() == pytest.approx(sum(kls) / len(kls), rel=1e-5)


# -- the engines' complete and the capability ---------------------------------------------------------------------------
def test_the_in_process_engine_completes_token_contexts():
    policy = tiny_policy()
    engine = HFEngine(env=MAZE, runtime=EnvRuntime(), max_context=512)
    engine.connect(policy)
    policy.model.train()
    ctx = [list(tiny_tokenizer().encode("Goal: 2 south.")), [5, 6, 7]]
    sampling = Sampling(temperature=1.0, max_action_tokens=6, seed=3)
    out = engine.complete(ctx, sampling, n=3, batch_size=2)
    assert [len(row) for row in out] == [3, 3]
    for s in (x for row in out for x in row):
        assert isinstance(s, Sampled) and 1 <= len(s.ids) <= 6
        assert all(i not in policy.chat.stop_ids for i in s.ids[:-1])  # it stops at the first stop id
    again = engine.complete(ctx, sampling, n=3, batch_size=2)
    assert [[x.ids for x in row] for row in again] == [[x.ids for x in row] for row in out]
    assert policy.model.training  # its mode restored


def test_the_vllm_engine_completes_through_its_server_requests():
    from cope.rollout.vllm.client import Completion
    from cope.rollout.vllm.engine import VLLMEngine

    engine = VLLMEngine(env=MAZE, runtime=EnvRuntime(), max_context=512)
    sent = []

    def answer(requests):
        sent.extend(requests)
        return [Completion([7, 8, tiny_chat().stop_id], [-0.1, -0.2, -0.3], "stop") for _ in requests]

    engine.policy, engine._complete = SimpleNamespace(chat=tiny_chat()), answer
    engine.server = SimpleNamespace(managed=False, url="http://127.0.0.1:1")
    engine.versions = SimpleNamespace(using=lambda v: contextlib.nullcontext("cope-rank0-v3"))
    out = engine.complete([[1, 2], [3]], Sampling(max_action_tokens=5, seed=11), n=2, batch_size=3)
    assert [[s.ids for s in row] for row in out] == [[[7, 8, tiny_chat().stop_id]] * 2] * 2 and out[0][0].logprobs == [-0.1, -0.2, -0.3]
    assert [r["prompt"] for r in sent] == [[1, 2], [1, 2], [3], [3]]
    assert {r["model"] for r in sent} == {"cope-rank0-v3"} and all(r["max_tokens"] == 5 for r in sent)
    assert all(r["stop_token_ids"] == list(tiny_chat().stop_ids) for r in sent)
    assert len({r["seed"] for r in sent}) == 4  # one stream per row
    seeds = [r["seed"] for r in sent]
    sent.clear()
    engine.complete([[1, 2], [3]], Sampling(max_action_tokens=5, seed=11), n=2)
    assert [r["seed"] for r in sent] == seeds  # the batching changes no seed


def test_rwml_needs_an_engine_that_completes_and_collect_then_train(scripted):
    from cope.rollout.vllm.engine import VLLMEngine

    assert engine_completes(HFEngine) and engine_completes(VLLMEngine) and not engine_completes(SimpleNamespace)
    (ep,), *_ = scripted
    with pytest.raises(ValueError, match=r"data\.engine: algo=rwml .* SimpleNamespace cannot"):
        RWMLCollector(host=_host([ep], SimpleNamespace()))
    lagged = functools.partial(LaggedCollector, max_lag=1)
    with pytest.raises(ValueError, match=r"data\.max_lag: algo=rwml wraps collect-then-train only"):
        RWMLCollector(host=_host([ep], type("Overlapping", (), {"completes": True, "overlaps": True})()), inner=lagged)
    with pytest.raises(ValueError, match=r"rwml\.predictions must be >= 2, got 1"):
        RWMLCollector(host=_host([ep], FakeEngine(None, {}, None)), predictions=1)
    greedy = dataclasses.replace(_host([ep], FakeEngine(None, {}, None)), sampling=Sampling(temperature=0.0))
    with pytest.raises(ValueError, match=r"data\.sampling\.temperature=0"):
        RWMLCollector(host=greedy)


# -- algo=rwml_grpo end to end: stage switch and resume -----------------------------------------------------------------
# a maze a 150-step warm start sometimes walks validly (so triplets exist), no validation; RWML epochs 0, 1, GRPO 2, 3
RUN = ["algo=rwml_grpo", "rwml.epochs=2", "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1",
       "validate_before_fit=false", "trainer.check_val_every_n_epoch=100", "callbacks.stop_token.every_n_epochs=0"]


@pytest.mark.slow  # four training runs, ten epochs: about two minutes on 2 cores
def test_stage_switch_and_resume_inside_each_stage_equal_the_straight_run(run_train, tmp_path):
    from safetensors.torch import load_file

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    run_train([*RUN, "trainer.max_epochs=4"], straight)
    run_train([*RUN, "trainer.max_epochs=1"], cut)  # saved inside the RWML stage
    run_train([*RUN, "trainer.max_epochs=3", "ckpt_path=last"], cut)  # resumes in it, switches, saved inside GRPO
    run_train([*RUN, "trainer.max_epochs=4", "ckpt_path=last"], cut)  # resumes inside the GRPO stage
    want = metric_rows(straight / "csv" / "metrics.csv")
    stages = [float(r["rwml/stage"]) for r in want if "rwml/stage" in r]
    assert stages == [1.0, 1.0, 0.0, 0.0]
    assert any(float(r["rwml/kept"]) > 0 for r in want if "rwml/kept" in r)  # RWML epochs trained predictions
    assert metric_rows(cut / "csv" / "metrics.csv") == want
    a, b = (load_file(str(d / "csv" / "adapter" / "adapter_model.safetensors")) for d in (straight, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
