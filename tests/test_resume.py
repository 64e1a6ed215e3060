"""Resuming from last.ckpt: weights, optimizer, loop position and experience counters continue.

Runs 2 epochs, then resumes to 3 epochs from the checkpoint into the same output folder. `algo=echo`
so that every epoch moves the adapter (with debug=fast the cold-start policy makes only invalid moves,
so the policy-gradient alone would leave it unchanged). A probe on `on_train_start` records the state
the resumed fit starts from."""
from __future__ import annotations

import pytest
import torch
from conftest import metric_rows
from safetensors.torch import load_file

from cope.train.module import AgentRLModule

pytestmark = pytest.mark.long  # three training runs (module fixtures)

PER_EPOCH = 2 * 4  # debug=fast: tasks_per_epoch * group_size
ALGO = "algo=echo"


@pytest.fixture(scope="module")
def resumed(run_train, read_metrics, tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    first = run_train([ALGO, "trainer.max_epochs=2"], out)
    ckpt_file = out / "checkpoints" / "last.ckpt"
    saved = torch.load(ckpt_file, map_location="cpu", weights_only=False)  # read now: the resumed run overwrites it
    adapter_2 = load_file(str(out / "csv" / "adapter" / "adapter_model.safetensors"))
    cols_2 = read_metrics(out / "csv" / "metrics.csv")

    start: dict = {}

    def probe(self):
        start["params"] = {n: p.detach().clone() for n, p in self.named_parameters() if p.requires_grad}
        start["counters"] = dict(self.trainer.datamodule.counters)
        start["global_step"], start["epoch"] = self.trainer.global_step, self.current_epoch
        start["adam_steps"] = [float(s["step"]) for s in self.trainer.optimizers[0].state.values()]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AgentRLModule, "on_train_start", probe)
        second = run_train([ALGO, "trainer.max_epochs=3", f"ckpt_path={ckpt_file}"], out)
    final = torch.load(ckpt_file, map_location="cpu", weights_only=False)
    return dict(out=out, first=first, second=second, saved=saved, final=final, start=start, adapter_2=adapter_2,
                adapter_3=load_file(str(out / "csv" / "adapter" / "adapter_model.safetensors")), cols_2=cols_2,
                cols_3=read_metrics(out / "csv" / "metrics.csv"))


def test_counters_continue(resumed):
    assert resumed["first"]["counters/episodes"] == 2 * PER_EPOCH
    # at on_train_start the first resumed epoch's rollouts are already collected (the fit loop loads the
    # train dataloader first): restored 2 epochs + 1, where a non-restored datamodule would show 1
    assert resumed["saved"]["RolloutDataModule"]["counters"]["episodes"] == 2 * PER_EPOCH
    assert resumed["start"]["counters"]["episodes"] == 3 * PER_EPOCH
    assert resumed["second"]["counters/episodes"] == 3 * PER_EPOCH  # not 1 epoch's worth
    for k in ("env_steps", "generated_tokens", "train_tokens"):
        assert resumed["second"][f"counters/{k}"] > resumed["first"][f"counters/{k}"], k
    assert resumed["final"]["RolloutDataModule"]["counters"]["episodes"] == 3 * PER_EPOCH


def test_loop_and_optimizer_restored(resumed):
    s = resumed["start"]
    assert (s["epoch"], s["global_step"]) == (2, 2)
    assert s["adam_steps"] and all(n == 2 for n in s["adam_steps"])  # AdamW moments came back, not a fresh optimizer
    # written at the end of the last epoch (0-based index 2), after its one optimizer step
    assert (resumed["final"]["epoch"], resumed["final"]["global_step"]) == (2, 3)


def test_adapter_restored_at_resume_start(resumed):
    params, sd = resumed["start"]["params"], resumed["saved"]["state_dict"]
    assert set(params) == set(sd)
    for k, v in sd.items():
        assert torch.equal(params[k], v), k


def test_adapter_moves_after_resume(resumed):
    a2, a3 = resumed["adapter_2"], resumed["adapter_3"]
    assert set(a2) == set(a3)
    assert any(not torch.equal(a2[k], a3[k]) for k in a2), "the resumed epoch did not update the exported adapter"


@pytest.fixture(scope="module")
def straight(run_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    result = run_train([ALGO, "trainer.max_epochs=3"], out)
    return result, load_file(str(out / "csv" / "adapter" / "adapter_model.safetensors")), out


def test_resume_equals_uninterrupted_run(resumed, straight):
    """2 epochs + resume to 3 == 3 epochs in one go: task stream, sampling seeds, weights, optimizer all continue."""
    result, adapter, _ = straight
    counters = [k for k in result if k.startswith("counters/")]
    assert counters and {k: resumed["second"][k] for k in counters} == {k: result[k] for k in counters}
    assert resumed["adapter_3"].keys() == adapter.keys()
    for k, v in adapter.items():
        assert torch.equal(resumed["adapter_3"][k], v), k


def test_metrics_csv_after_resume(resumed):
    assert resumed["cols_2"]["counters/episodes"] == [PER_EPOCH, 2 * PER_EPOCH]
    assert resumed["cols_3"]["counters/episodes"][-1] == 3 * PER_EPOCH
    assert max(resumed["cols_3"]["epoch"]) == 2


def test_metrics_csv_keeps_history_on_resume(resumed):
    assert resumed["cols_3"]["counters/episodes"] == [PER_EPOCH, 2 * PER_EPOCH, 3 * PER_EPOCH]


def test_initial_adapter_independent_of_cache(compose, tmp_path, monkeypatch):
    """Same seed, same starting LoRA weights whether the tiny base is built now (cold cache) or loaded."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    monkeypatch.setenv("COPE_CACHE", str(tmp_path / "fresh_cache"))
    cfg = compose([], tmp_path)
    inits = []
    for _ in range(2):  # 1st builds the base (reseeding torch for its warm start), 2nd loads it
        pl.seed_everything(cfg.seed)
        policy = instantiate(cfg.model)(env_factory=instantiate(cfg.env))
        inits.append({n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad})
    assert inits[0].keys() == inits[1].keys()
    for k in inits[0]:
        assert torch.equal(inits[0][k], inits[1][k]), k


class _Killed(Exception):
    """Stands in for a SIGKILL: nothing after the raising line runs, and Lightning logs nothing more on the way out."""


def test_a_kill_right_after_the_epoch_checkpoint_loses_no_metrics_row(run_train, tmp_path):
    """Lightning writes an epoch's checkpoint (the epoch-end callbacks) before it logs that epoch's metrics row
    (``update_train_epoch_metrics``). A run that dies between the two resumes after that epoch: the row travels in
    the checkpoint and the resumed run logs it, so metrics.csv ends equal to the uninterrupted run's, row for row.
    The death is a SIGKILL's: metrics.csv is put back as it was on disk at that moment (the exception's unwinding
    saves the loggers; a SIGKILL saves nothing), so rows still buffered in a logger then are lost here too. Each row
    Lightning logs itself saves every row logged before it, so none is logged in the killed epoch: GRPO (ECHO logs
    ``echo/scale`` per step), ``log_every_n_steps`` 50 (as in every trainer config but ``cpu``), no validation. Only
    the trainer's own saves keep its step rows; without them (``cope.train.dist.log_now``) they were lost."""
    import shutil

    from cope.callbacks.checkpoint import EpochCheckpoint

    save = EpochCheckpoint.on_train_epoch_end
    args = ["algo=grpo", "trainer.max_epochs=3", "trainer.log_every_n_steps=50", "trainer.check_val_every_n_epoch=100"]
    run_train(args, tmp_path / "straight")
    run_dir = tmp_path / "cut"
    csv_file, on_disk = run_dir / "csv" / "metrics.csv", tmp_path / "metrics_at_the_kill.csv"

    def save_then_die(self, trainer, pl_module):
        save(self, trainer, pl_module)
        if trainer.current_epoch == 1:
            assert self.path.exists()
            shutil.copy(csv_file, on_disk)
            raise _Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EpochCheckpoint, "on_train_epoch_end", save_then_die)
        with pytest.raises(_Killed):
            run_train(args, run_dir)
    shutil.copy(on_disk, csv_file)
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] == 1
    run_train([*args, "ckpt_path=last"], run_dir)
    rows, want = metric_rows(csv_file), metric_rows(tmp_path / "straight" / "csv" / "metrics.csv")
    assert [r.get("rollout/success") for r in rows if "counters/episodes" in r] == \
        [r.get("rollout/success") for r in want if "counters/episodes" in r]  # the epoch rows: 3, none lost
    assert rows == want
