"""CoPE's separate forecast step with shared prefixes (``data.share_prefix=true``): the samples of one episode in a
step are branches of one row over its transcript (tree attention), and the step's loss and every LoRA gradient equal
one row per sample under SDPA (the dense reference), on the project's tiny architecture (Qwen2) and on Llama, whole
and micro-batched; the tree is the samples' own sequences; the batch trains through Lightning (its packed rows move
with it) with fewer tokens forwarded; a model not on tree attention gets the tree's dense mask; the model serves
ordinary batches as SDPA."""
from __future__ import annotations

import pytest
import torch
from forecast_fixtures import capture_logger
from prompted_fixtures import CHAT, FakeTokenizer, reference_episode, simple_episode
from tiny_fixtures import exactness_model

from cope.algos.cope.loss import ForecastLoss
from cope.algos.cope.packing import collate_chunks
from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.algos.cope.shared_prefix import collate_shared
from cope.models.policy import Policy
from cope.train.module import AgentRLModule
from cope.train.packing.tree_attention import NAME
from cope.train.packing.tree_batch import use_tree_attention
from cope.train.step.backward import backward_microbatched

PAD = 0
STEP = 4  # cope.minibatch_size here: the reference episode's five samples are split over steps 0 and 1


def _model(arch: str = "qwen2"):
    return exactness_model(arch, vocab_size=128)


def _episodes():
    """The reference episode (5 steps), two wins and a loss of group 1, and a one-step win (a single sample)."""
    return [reference_episode(), simple_episode(3, 1.0, group=1), simple_episode(2, 1.0, group=1),
            simple_episode(2, 0.0, group=1), simple_episode(1, 1.0, group=2)]


def _steps(eps):
    chunks, _ = build_prompted(eps, CHAT, PlanPrompt(FakeTokenizer()), K=3)
    steps = [chunks[s: s + STEP] for s in range(0, len(chunks), STEP)]
    # what the cases below rely on: an episode split across two steps, a step holding one sample of an episode, and
    # every episode's sample at its first action
    assert {c.episode for c in steps[0]} & {c.episode for c in steps[1]} == {0}
    assert [c.episode for c in steps[-1]].count(4) == 1 and sum(c.step == 0 for c in chunks) == 4
    assert len({c.weight for c in chunks}) > 1  # group weights differ
    return steps


def _module(model, budget=None):
    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"),
                           [ForecastLoss(weight=1.0, update="separate")], optimizer=torch.optim.SGD,
                           max_tokens_per_microbatch=budget)
    module.manual_backward = lambda loss: loss.backward()  # no trainer here: the plain autograd call
    return module


def _step(module, batch):
    """One separate step's loss (as training_step takes it: micro-batched under the module's budget) and LoRA grads."""
    module.zero_grad(set_to_none=True)
    _, total, metrics = backward_microbatched(module, batch)
    return total, metrics, [p.grad.clone() for p in module.policy.trainable_parameters()]


def _check_steps(arch: str, budget: int | None, device: str = "cpu", tol: float = 1e-5) -> None:
    """Every step of the fixtures' samples: shared rows under tree attention vs one row per sample under SDPA."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    model, eps = _model(arch).to(device), _episodes()
    module = _module(model, budget).to(device)  # the module's device is where micro-batched log-probs are assembled
    steps = _steps(eps)
    dense = [_step(module, move_data_to_device(collate_chunks(eps, chunks, PAD), device)) for chunks in steps]  # reference
    use_tree_attention(model)
    assert model.get_base_model().config._attn_implementation == NAME
    for chunks, (ref_loss, ref_m, ref_grads) in zip(steps, dense):
        shared = collate_shared(eps, chunks, PAD, budget)  # as the callback builds it: rows within the budget
        if budget is not None:
            alone = max(c.anchor + len(c.tokens) for c in chunks)  # the longest one-sample tree
            assert int(shared["attention_mask"].sum(-1).max()) <= max(budget, alone)
        loss, m, grads = _step(module, move_data_to_device(shared, device))
        assert loss.item() == pytest.approx(ref_loss.item(), abs=tol) and loss.item() > 0
        assert m["forecast/chunks"] == ref_m["forecast/chunks"] == len(chunks) and m["forecast/tokens"] == ref_m["forecast/tokens"]
        assert len(grads) == len(ref_grads) and all(g.abs().sum() > 0 for g in grads)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("budget", [None, 40])  # 40 tokens: every shared row is a micro-batch of its own, cut short
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_each_step_equals_one_row_per_sample(arch, budget):
    _check_steps(arch, budget)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [None, 40])
def test_each_step_equals_one_row_per_sample_on_cuda(budget):
    _check_steps("qwen2", budget, "cuda", 1e-4)


def test_branches_are_the_samples_own_sequences():
    """Each branch with the trunk tokens it sees is the sample's dense row (``tokens[:anchor] + chunk.tokens``), at
    the same positions, with the same targets; each episode's trunk stops at the largest anchor the step needs; the
    trees share rows where they fit (no row longer than the longest tree), and a row of one tree names its episode."""
    eps = _episodes()
    for chunks in _steps(eps):
        dense, shared = collate_chunks(eps, chunks, PAD), collate_shared(eps, chunks, PAD)
        layout = shared["packed"].tree
        assert torch.equal(shared["position_ids"], layout.position_ids())
        assert torch.equal(shared["forecast_weight"], dense["forecast_weight"])
        assert torch.equal(shared["forecast_actions"], dense["forecast_actions"])
        trees = {}  # episode -> (row, root node index, branch node indices)
        for r, nodes in enumerate(layout.rows):
            roots = [k for k, n in enumerate(nodes) if n.parent == -1]
            for k in roots:
                branches = [b for b, n in enumerate(nodes) if n.parent == k]
                cids = {int(shared["forecast_chunk"][r, nodes[b].end - 1]) for b in branches}
                (e,) = {chunks[c].episode for c in cids}  # one episode per tree
                trees[e] = (r, k, branches)
            held = {chunks[int(c)].episode for c in shared["forecast_chunk"][r].unique() if c >= 0}
            assert int(shared["episode_index"][r]) == (held.pop() if len(held) == 1 else -1)
        assert sorted(trees) == sorted({c.episode for c in chunks})
        assert max(layout.rows[r][k].end - layout.rows[r][k].start + sum(layout.rows[r][b].end - layout.rows[r][b].start for b in bs)
                   for r, k, bs in trees.values()) == int(shared["attention_mask"].sum(-1).max())  # the longest tree: a row
        for e, (r, k, branches) in trees.items():
            mine = [i for i, c in enumerate(chunks) if c.episode == e]
            trunk = layout.rows[r][k]
            assert trunk.end - trunk.start == max(chunks[i].anchor for i in mine) - 1
            assert len(branches) == len(mine)
            for i, b in zip(mine, branches):  # node order = chunk order
                seq = layout.unshared()[r][b]
                n = int(dense["attention_mask"][i].sum())
                assert shared["input_ids"][r, seq].tolist() == dense["input_ids"][i, :n].tolist()
                assert shared["position_ids"][r, seq].tolist() == list(range(n))
                assert shared["forecast_mask"][r, seq].tolist() == dense["forecast_mask"][i, :n].tolist()
                assert set(shared["forecast_chunk"][r, seq[-len(chunks[i].tokens):]].tolist()) == {i}
        assert int(shared["attention_mask"].sum()) <= int(dense["attention_mask"].sum())
    assert collate_shared(eps, [], PAD).keys() == collate_chunks(eps, [], PAD).keys()  # an idle rank's batch: the same


def test_a_model_not_on_tree_attention_gets_the_trees_dense_mask():
    """The one place that decides how a tree is attended: tree attention computes only the cells a query sees, any
    other attention the tree's dense mask (the reference); both give the same log-probs."""
    model, eps = _model(), _episodes()
    batch = collate_shared(eps, _steps(eps)[0], PAD)
    with torch.no_grad():
        dense = _module(model)(batch).logprobs
        use_tree_attention(model)
        tree = _module(model)(batch).logprobs
    assert dense.abs().sum() > 0
    torch.testing.assert_close(tree, dense, atol=1e-5, rtol=1e-5)
    base = model.get_base_model()
    base.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="model.attn_implementation=sdpa, or turn the sharing off"):
        use_tree_attention(model)


def test_the_switched_model_serves_ordinary_batches_as_sdpa():
    """Rollouts and scoring pass no layout: the logits of a padded batch are bit-identical to SDPA's."""
    model = _model()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        use_tree_attention(model)
        use_tree_attention(model)  # idempotent
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, ref)


def _fit(batch, model) -> tuple[list[dict], list[torch.Tensor], list[torch.Tensor]]:
    """One Lightning epoch of one forecast batch: the logged rows, the gradient the optimizer stepped on and the
    adapter after the step. SGD, not AdamW: Adam's first step is about lr x g / (|g| + eps), so a gradient element
    near 0 turns fp32 rounding (which differs between CPU kernels) into a move of order lr; SGD's is lr x g."""
    import lightning.pytorch as pl

    class Grads(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.seen = [p.grad.detach().clone() for p in pl_module.policy.trainable_parameters()]

    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"),
                           [ForecastLoss(weight=1.0, update="separate")], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    capture, grads = capture_logger(), Grads()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=[capture], callbacks=[grads],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    return [m for _, m in capture.rows], grads.seen, [p.detach().clone() for p in module.policy.trainable_parameters()]


def test_a_shared_step_trains_through_lightning_with_fewer_tokens():
    """Lightning moves the batch (its PrefixTree included) to the device and takes the step: the adapter lands where
    the dense step puts it (the same gradient, an SGD step), the logged losses agree and
    ``forecast/tokens_forwarded`` counts the shared row once."""
    eps = _episodes()
    chunks = _steps(eps)[0]
    before = [p.detach().clone() for p in _model().parameters() if p.requires_grad]
    dense_rows, dense_grads, dense_after = _fit(collate_chunks(eps, chunks, PAD), _model())
    model = _model()
    use_tree_attention(model)
    shared_rows, shared_grads, shared_after = _fit(collate_shared(eps, chunks, PAD), model)
    (d,), (s,) = ([r for r in rows if "forecast/tokens_forwarded" in r] for rows in (dense_rows, shared_rows))
    assert {c.episode for c in chunks} == {0}  # one episode: one trunk (up to the last anchor but one) + the branches
    assert s["forecast/tokens_forwarded"] == max(c.anchor for c in chunks) - 1 + sum(1 + len(c.tokens) for c in chunks)
    assert d["forecast/tokens_forwarded"] == sum(c.anchor + len(c.tokens) for c in chunks)
    assert s["forecast/tokens_forwarded"] < 0.65 * d["forecast/tokens_forwarded"]
    for k in ("loss/forecast", "forecast/nll", "forecast/chunks", "forecast/tokens"):
        assert s[k] == pytest.approx(d[k], abs=1e-5), k
    assert len(shared_grads) == len(dense_grads) == len(before)
    for a, b in zip(shared_grads, dense_grads):  # the same step: the same gradient
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    for a, b in zip(shared_after, dense_after):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert max(float((a - w).abs().max()) for a, w in zip(dense_after, before)) > 100 * 1e-5  # the step moved it


# A warm-started maze the policy sometimes solves (wins, so the policy gradient is not 0), every episode a sample
# source, 8 samples per forecast step: about 50 forecast steps in 4 epochs.
RUN = ["algo=cope", "model.warm_start_steps=150", "model.warm_start_policy=expert", "env.sizes=[5]", "env.min_distance=1",
       "data.tasks_per_epoch=4", "cope.gate=all", "cope.minibatch_size=8", "trainer.max_epochs=4"]
SAME = ("loss/forecast", "loss/pg", "forecast/", "val/success", "rollout/success")


@pytest.mark.long
@pytest.mark.parametrize("update", ["separate", "joint"])
def test_a_run_with_shared_prefixes_logs_what_one_row_per_sample_logs(run_train, read_metrics, tmp_path, update):
    """``algo=cope`` on the tiny model, sharing on and off: every policy step, forecast step and validation logs the
    same values to fp32 noise (the runs then draw the same rollouts); the shared separate steps forward fewer tokens.
    Joint: the packed rows through tree attention vs their trees' dense mask, the same tokens. SGD, not the default
    AdamW: Adam's first step is about lr x g / (|g| + eps), which turns the two runs' fp32 rounding of a near-zero
    gradient element (it differs between CPU kernels) into a move of order lr; SGD's step is lr x g."""
    cols = {}
    sgd = ["module.optimizer._target_=torch.optim.SGD", "module.optimizer.lr=0.2"]
    for share in ("true", "false"):
        run_train([*RUN, *sgd, f"cope.update={update}", f"data.share_prefix={share}"], tmp_path / share)
        cols[share] = read_metrics(tmp_path / share / "csv" / "metrics.csv")
    shared, dense = cols["true"], cols["false"]
    keys = sorted(k for k in dense if k.startswith(SAME) and k != "forecast/tokens_forwarded")
    assert {"loss/forecast", "loss/pg", "forecast/nll", "val/success"} <= set(keys)
    steps = 30 if update == "separate" else 7  # joint: the policy steps only (2 per epoch)
    assert len(dense["forecast/nll"]) >= steps and any(abs(v) > 1e-3 for v in dense["loss/pg"])  # many steps, a PG signal
    if update == "joint":
        assert "forecast/tokens_forwarded" not in dense
        _same_rows(shared, dense, keys)
        return
    assert "forecast/grad_norm" in keys
    _same_rows(shared, dense, keys)
    fwd = [(a, b) for a, b in zip(shared["forecast/tokens_forwarded"], dense["forecast/tokens_forwarded"])]
    assert all(a <= b for a, b in fwd) and sum(a for a, _ in fwd) < 0.7 * sum(b for _, b in fwd)


def _same_rows(shared: dict, dense: dict, keys: list[str]) -> None:
    """Every key logs the same rows, to fp32 noise."""
    for k in keys:
        assert len(shared[k]) == len(dense[k]), k
        for i, (a, b) in enumerate(zip(shared[k], dense[k])):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5), f"{k} row {i}: {a} vs {b}"


def test_temporal_ensemble_members_scored_on_shared_rows():
    """CoPE's temporal ensemble scores its members (``cope.te.weight > 0``) on the epoch's samples: each episode's
    samples as one tree over its transcript give the same top-M distributions as one row per sample."""
    import contextlib

    from cope.algos.cope.te_loss import ensemble_transform
    from cope.batch import collate

    model, eps = _model(), _episodes()
    chunks, _ = build_prompted(eps, CHAT, PlanPrompt(FakeTokenizer()), K=3)
    got = []
    for share in (False, True):
        if share:
            use_tree_attention(model)
        mbs = [collate(eps[:3], PAD, indices=[0, 1, 2]), collate(eps[3:], PAD, indices=[3, 4])]
        ensemble_transform(lambda: model, lambda _: chunks, contextlib.nullcontext, top_m=8, rows_per_forward=STEP,
                           share_prefix=share)(mbs, eps)
        got.append(mbs)
    assert got[0][0]["te_ids"].shape[0] > 0  # the reference episode's actions have members
    for plain, shared in zip(*got):
        assert torch.equal(plain["te_position"], shared["te_position"])
        assert torch.equal(plain["te_ids"], shared["te_ids"])
        torch.testing.assert_close(shared["te_probs"], plain["te_probs"], atol=1e-5, rtol=1e-5)
