"""``cope.train.fsdp.checkpoint`` in one process (no process group): a save round-trips the trained tensors and the
optimizer state; a save cut short never leaves a folder that passes for a checkpoint, and the previous one stays
loadable, also when the cut falls between the two renames."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cope.run.checkpoint_io import CheckpointReadError, check_checkpoint_file, read_checkpoint
from cope.run.train import resolve_ckpt_path
from cope.train.fsdp import checkpoint as sc


class Died(RuntimeError):
    pass


def _strategy(die_at: str | None = None):
    def barrier(name=None):
        if name == die_at:
            raise Died(name)
    return SimpleNamespace(is_global_zero=True, barrier=barrier)


def _trained(seed: int):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    module[1].requires_grad_(False)  # frozen: never written
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=0.1)
    module(torch.randn(5, 4)).sum().backward()
    opt.step()
    return module, opt


def _checkpoint(module, opt, epoch: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    return {"state_dict": get_model_state_dict(module, options=StateDictOptions(ignore_frozen_params=True)),
            "optimizer_states": [get_optimizer_state_dict(module, opt)], "epoch": epoch, "finetune": "full"}


def test_round_trip_and_metadata(tmp_path):
    module, opt = _trained(0)
    path = tmp_path / "last.ckpt"
    sc.save(_strategy(), _checkpoint(module, opt, epoch=3), path)
    assert sc.is_sharded_checkpoint(path) and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    meta = read_checkpoint(path)  # what the pre-build checks read: no tensor data
    assert meta["epoch"] == 3 and meta["finetune"] == "full" and sc.optimizer_keying(meta) == "parameter name"
    assert {k: tuple(v.shape) for k, v in meta["state_dict"].items()} == {"0.weight": (3, 4), "0.bias": (3,)}
    fresh, fresh_opt = _trained(1)
    assert not torch.equal(fresh[0].weight, module[0].weight)
    got = sc.load(path, fresh, [fresh_opt])
    assert got["epoch"] == 3 and "state_dict" not in got
    for a, b in zip(fresh.parameters(), module.parameters()):
        assert torch.equal(a, b) if a.requires_grad else not torch.equal(a, b)  # the frozen layer is not in the file
    moments = [fresh_opt.state[p]["exp_avg"] for p in fresh.parameters() if p.requires_grad]
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, [q for q in module.parameters() if q.requires_grad]))
    read = sc.load_trained_tensors(path, {"0.weight": torch.zeros(3, 4)})  # eval.py's reader
    assert torch.equal(read["0.weight"], module[0].weight)


@pytest.mark.parametrize("die_at", ["sharded_checkpoint.written", "sharded_checkpoint.done"])
def test_a_cut_save_leaves_the_previous_checkpoint(tmp_path, die_at):
    """Cut before meta.pt is written (a rank died while writing its shards): the new folder is not a checkpoint and the
    previous one is untouched. Cut after the swap: the new one is complete. The next save clears the leftovers."""
    module, opt = _trained(0)
    path = tmp_path / "checkpoints" / "last.ckpt"
    sc.save(_strategy(), _checkpoint(module, opt, epoch=1), path)
    with pytest.raises(Died):
        sc.save(_strategy(die_at), _checkpoint(module, opt, epoch=2), path)
    want = 1 if die_at == "sharded_checkpoint.written" else 2
    assert read_checkpoint(resolve_ckpt_path("last", path.parent))["epoch"] == want
    tmp = path.with_name(path.name + sc.TMP)
    if want == 1:
        assert tmp.is_dir() and not sc.is_sharded_checkpoint(tmp)
        with pytest.raises(CheckpointReadError, match="not a complete sharded checkpoint"):
            check_checkpoint_file(tmp)
    sc.save(_strategy(), _checkpoint(module, opt, epoch=5), path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"] and read_checkpoint(path)["epoch"] == 5


def test_a_cut_between_the_renames_resumes_the_previous_one(tmp_path):
    module, opt = _trained(0)
    path = tmp_path / "last.ckpt"
    sc.save(_strategy(), _checkpoint(module, opt, epoch=1), path)
    path.rename(path.with_name(path.name + sc.OLD))  # the first rename done, the second not
    resolved = resolve_ckpt_path("last", tmp_path)
    assert resolved.endswith(sc.OLD) and read_checkpoint(resolved)["epoch"] == 1
    fresh, fresh_opt = _trained(1)
    assert sc.load(path, fresh, [fresh_opt])["epoch"] == 1 and torch.equal(fresh[0].weight, module[0].weight)
