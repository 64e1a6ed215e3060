"""What a GPU run does that the fp32, one-process CPU tests did not show, reproduced on CPU in the precision and
process count the GPU run uses (bf16 mixed precision runs on CPU too; gloo stands in for NCCL).

* FSDP2 casts every floating tensor of a sharded module's forward inputs to the compute dtype, walking into
  dataclasses and rebuilding them field by field. A prefix tree (``data.share_prefix=true``) travels in those inputs:
  it must come through unchanged (the same object, whose per-device kernel tensors are built once and reused by every
  layer), and the tree forward must equal the dense-mask forward of the same sharded bf16 model.
* A checkpoint's state dict reshards the FSDP groups behind the trainer's back: the next gather must gather again.
* Overlapped rollouts sample in a thread of their own, and autocast is per thread: the sampler must compute under the
  training step's precision, or its log-probs differ from the scoring pass's by precision, not by sampling.
"""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from cope.train.packing.prefix_tree import PrefixTree
from cope.train.packing.tree_batch import use_tree_attention


def _sharded_bf16_pair(tmp_path):
    """A tiny Qwen2 (GQA: 4 query heads, 2 key/value heads) twice, sharded by the project's ``shard_policy`` with the bf16
    policy of ``FSDPStrategy.mp_policy``: one on tree attention, one on SDPA."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from cope.train.fsdp.sharding import shard_policy

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    tree_model = Qwen2ForCausalLM(cfg)
    dense_model = copy.deepcopy(tree_model)
    use_tree_attention(tree_model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_policy(tree_model, mesh, policy)
    shard_policy(dense_model, mesh, policy)
    return tree_model, dense_model


def test_tree_forward_under_fsdp_bf16_mixed_precision(tmp_path):
    import torch.distributed as dist

    # row 0: a root of 5 tokens and a branch after its first 3; row 1: one plain sequence, then padding
    tree = PrefixTree.from_lists([[(0, 5, -1, 0), (5, 8, 0, 3)], [(0, 6, -1, 0)]], length=8)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    pos = tree.position_ids()
    try:
        tree_model, dense_model = _sharded_bf16_pair(tmp_path)
        builds = []
        original = PrefixTree.cached

        def counting(self, key, build):  # which tree objects the kernels see, and what they build
            return original(self, key, lambda: builds.append((id(self), key)) or build())

        PrefixTree.cached = counting
        try:
            got = tree_model(input_ids=ids, position_ids=pos, prefix_tree=tree, use_cache=False).logits
        finally:
            PrefixTree.cached = original
        mask = torch.zeros(2, 1, 8, 8).masked_fill(~tree.dense_mask(), float("-inf"))  # (N, 1, T, T) additive
        want = dense_model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
    finally:
        dist.destroy_process_group()
    assert builds and {t for t, _ in builds} == {id(tree)}, "the kernels got a rebuilt tree, not the one passed in"
    assert len(builds) == len(set(builds)), builds  # each kernel tensor built once for both layers, not per layer
    assert got.dtype == want.dtype
    real = torch.cat([torch.ones(1, 8, dtype=torch.bool), torch.arange(8)[None] < 6])  # (2, 8) tokens in a node
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=2e-2, rtol=2e-2)


def test_prefix_tree_survives_generic_tensor_walkers():
    """The walkers FSDP (``_apply_to_tensors``) and Lightning (``move_data_to_device``) run over a forward's inputs hand
    the tree back as the same object: it holds no tensors to cast or move."""
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from torch.distributed.utils import _apply_to_tensors

    tree = PrefixTree.from_lists([[(0, 3, -1, 0), (3, 5, 0, 2)]])
    tree.cached("probe", lambda: 1)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16), {"prefix_tree": tree, "x": torch.zeros(1)})
    assert cast["prefix_tree"] is tree and cast["x"].dtype == torch.bfloat16
    assert move_data_to_device({"prefix_tree": tree}, "cpu")["prefix_tree"] is tree
    again = tree.replace(recompute=False)
    assert again == PrefixTree.from_lists([[(0, 3, -1, 0), (3, 5, 0, 2)]]).replace(recompute=False) and again != tree
    assert again.recompute is False and again.cached("probe", lambda: 2) == 2  # its own cache
    with pytest.raises(AttributeError):
        tree.length = 3  # frozen, as before


def _save_then_uneven_forward(rank: int, rendezvous: str, results) -> None:
    """One of 2 gloo ranks: gather the sharded model, take a checkpoint's state dict (which reshards every group), then
    gather again on every rank (what validation's start does) and forward on rank 0 only (rank 1's validation shard
    is empty)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from cope.train.fsdp.sharding import WholeWeights, shard_policy

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    try:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1))
        shard_policy(model, init_device_mesh("cpu", (2,)))
        whole = WholeWeights(model)
        whole.gather()
        assert whole.whole
        get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # the save
        after_save = whole.whole
        whole.gather()
        if rank == 0:
            model(torch.zeros(1, 4, dtype=torch.long), use_cache=False)
        dist.barrier()
        results.put((rank, after_save, "ok"))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        results.put((rank, None, repr(e)[:300]))
    finally:
        dist.destroy_process_group()


def test_gathered_state_is_read_off_the_groups_after_a_save(tmp_path):
    """A save reshards the groups behind WholeWeights' back; the next gather must gather again, or a rank with no
    forward after a save leaves the other waiting in a layer's all-gather (here: gloo's timeout instead of a hang)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_save_then_uneven_forward, args=(r, str(tmp_path / "rdzv"), results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    got = sorted(results.get(timeout=5) for _ in range(2))
    assert [g[2] for g in got] == ["ok", "ok"], got
    assert [g[1] for g in got] == [False, False], "WholeWeights still said gathered after the save resharded the groups"


@pytest.mark.long
def test_lagged_sampler_computes_in_the_training_precision(train_script, read_metrics, tmp_path):
    """``trainer.precision=bf16-mixed data.max_lag=1``: the first epoch is sampled (in the collector's thread) and
    scored (in the main thread) by the same weights, so the sampler's log-probs and the scoring pass's differ by
    numerics alone. Measured: 1.3e-6 mean per token with the sampler under the step's autocast, 3.3e-4 without it (the
    sampler in fp32 while the scoring pass runs in bf16): the bound sits 10x from each."""
    run = tmp_path / "run"
    proc = train_script(["debug=fast", "trainer.precision=bf16-mixed", "data.max_lag=1", "trainer.max_epochs=1",
                         "validate_before_fit=false", f"hydra.run.dir={run}"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gap = read_metrics(run / "csv" / "metrics.csv")["rollout/logprob_gap"]
    assert gap and gap[0] < 3e-5, gap
