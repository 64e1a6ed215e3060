"""Logging and export callbacks (TrajectoryTable, SampleEfficiency, AdapterExport, Throughput) driven
through their hooks with fake trainers, plus one tiny real Lightning fit that checks hook legality."""
import csv
import importlib.util
import io
import json
from types import SimpleNamespace

import pytest
import torch

from cope.callbacks.adapter_export import AdapterExport
from cope.callbacks.sample_efficiency import SampleEfficiency
from cope.callbacks.throughput import Throughput, count_tokens
from cope.callbacks.trajectory_table import COLUMNS, TrajectoryTable, pick_episodes
from cope.envs.base import Task
from cope.episode import Episode, Role, Step
from cope.records import EpochRecord, ValidationRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WORDS = ("system rules user assistant you see a wall moved north south go look warning unknown command "
         "nothing happens goal reached").split()


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "[UNK]", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(special + WORDS)}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, pad_token="<pad>", unk_token="[UNK]",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def make_episode(tok, turns, success, index=0):
    """ChatML-like transcript; ``turns`` = [(action, valid, reward, observation, harness)]."""
    ep = Episode(task=Task("toy", "train", index), group=index, success=success, score=float(success))
    ep.append(ids(tok, "<|im_start|> system rules <|im_end|> <|im_start|> user"), Role.PROMPT)
    ep.append(ids(tok, "you see a wall"), Role.OBSERVATION)
    ep.append(ids(tok, "<|im_end|> <|im_start|> assistant"), Role.PROMPT)
    ep.prompt_len = len(ep.tokens)
    for j, (action, valid, reward, obs, harness) in enumerate(turns):
        a0, a1 = ep.append(ids(tok, action + " <|im_end|>"), Role.ACTION)
        o0, _ = ep.append(ids(tok, "<|im_start|> user"), Role.PROMPT)
        ep.append(ids(tok, obs), Role.OBSERVATION)
        if harness:
            ep.append(ids(tok, harness), Role.HARNESS)
        _, o1 = ep.append(ids(tok, "<|im_end|> <|im_start|> assistant") if j < len(turns) - 1 else [], Role.PROMPT)
        ep.steps.append(Step(a0, a1, True, valid, action, reward=reward, obs_start=o0, obs_end=o1))
        ep.reward += reward
    return ep


def epoch_record(episodes, counters=None, epoch=0) -> EpochRecord:
    """The record RolloutDataModule publishes for an epoch (no minibatches: the callbacks do not read them)."""
    counters = dict(counters or {})
    return EpochRecord(epoch=epoch, episodes=list(episodes), minibatches=[], metrics={}, counters=counters)


def fake_trainer(tmp_path, **kw):
    """A trainer whose datamodule exposes just the public records surface (train_record, val_record, counters)."""
    counters = kw.pop("counters", {"episodes": 0, "env_steps": 0, "generated_tokens": 0, "train_tokens": 0})
    dm = SimpleNamespace(train_record=epoch_record(kw.pop("episodes", []), counters),
                         val_record=ValidationRecord(epoch=0, episodes=list(kw.pop("val_episodes", []))), counters=counters)
    base = dict(current_epoch=0, global_step=0, is_global_zero=True, log_dir=str(tmp_path), default_root_dir=str(tmp_path),
                loggers=[], datamodule=dm, callback_metrics={}, sanity_checking=False)
    base.update(kw)
    return SimpleNamespace(**base)


class Recorder:
    """Stands in for a logger (``log_metrics``) and for ``LightningModule.log``."""

    def __init__(self):
        self.metrics, self.logged = [], []
        self.saved = 0  # rows of ``metrics`` a save has written out

    def log_metrics(self, metrics, step=None):
        self.metrics.append((dict(metrics), step))

    def save(self):
        self.saved = len(self.metrics)

    def log(self, name, value, **kw):
        self.logged.append((name, float(value), kw))


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- TrajectoryTable


def test_pick_episodes_first_success_then_first_failure_then_rest():
    eps = [SimpleNamespace(success=s) for s in (False, False, True, False, True)]
    assert pick_episodes(eps, 3) == [2, 0, 1]
    assert pick_episodes(eps, 10) == [2, 0, 1, 3, 4]
    assert pick_episodes([SimpleNamespace(success=False)] * 3, 2) == [0, 1]
    assert pick_episodes([], 4) == []


def test_trajectory_jsonl_rows_decode_only_observation_and_harness(tok, tmp_path):
    fail = make_episode(tok, [("go north", False, 0.0, "nothing happens", "warning unknown command"),
                              ("go south", True, 0.0, "you moved south", "")], success=False, index=0)
    win = make_episode(tok, [("look", True, 1.0, "goal reached", "")], success=True, index=1)
    other = make_episode(tok, [("look", True, 0.0, "a wall", "")], success=False, index=2)
    win.sampled_epoch = 2  # sampled at the start of epoch 2, trained in epoch 3 (data.max_lag=1)
    trainer = fake_trainer(tmp_path, episodes=[fail, win, other], current_epoch=3)
    pl_module = SimpleNamespace(policy=SimpleNamespace(tokenizer=tok))
    TrajectoryTable(num_episodes=2).on_train_epoch_end(trainer, pl_module)
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    assert [list(r) for r in rows] == [COLUMNS] * 3
    assert [(r["episode"], r["step"]) for r in rows] == [(1, 0), (0, 0), (0, 1)]  # success first, then the failure
    assert rows[0] == {"epoch": 3, "task": "toy/train/1", "episode": 1, "step": 0, "action": "look", "valid": True,
                       "reward": 1.0, "observation": "goal reached", "sampled_epoch": 2}
    assert rows[1]["observation"] == "nothing happens warning unknown command"  # harness kept, scaffold dropped
    assert rows[1]["valid"] is False and rows[2]["valid"] is True
    assert rows[2]["observation"] == "you moved south" and rows[2]["action"] == "go south"
    # a second epoch appends; the epoch column tells them apart
    trainer.current_epoch = 4
    TrajectoryTable(num_episodes=1, max_chars=3).on_train_epoch_end(trainer, pl_module)
    rows = read_jsonl(tmp_path / "trajectories.jsonl")
    assert len(rows) == 4 and rows[-1]["epoch"] == 4 and rows[-1]["observation"] == "goa"  # cut to max_chars
    assert rows[-1]["action"] == "look"  # an action is never cut: algo=sft replays this file


def test_trajectory_every_n_epochs_rank_zero_and_empty(tok, tmp_path):
    ep = make_episode(tok, [("look", True, 0.0, "a wall", "")], success=False)
    pl_module = SimpleNamespace(policy=SimpleNamespace(tokenizer=tok))
    cb = TrajectoryTable(every_n_epochs=2)
    cb.on_train_epoch_end(fake_trainer(tmp_path, episodes=[ep], current_epoch=0), pl_module)
    assert not (tmp_path / "trajectories.jsonl").exists()
    cb.on_train_epoch_end(fake_trainer(tmp_path, episodes=[ep], current_epoch=1, is_global_zero=False), pl_module)
    assert not (tmp_path / "trajectories.jsonl").exists()
    cb.on_train_epoch_end(fake_trainer(tmp_path, episodes=[], current_epoch=1), pl_module)
    assert not (tmp_path / "trajectories.jsonl").exists()
    cb.on_train_epoch_end(fake_trainer(tmp_path, episodes=[ep], current_epoch=1, log_dir=None), pl_module)
    assert len(read_jsonl(tmp_path / "trajectories.jsonl")) == 1  # falls back to default_root_dir


@pytest.mark.parametrize("kw", [{"num_episodes": 0}, {"every_n_epochs": 0}, {"max_chars": -1}, {"num_episodes": 1.5}])
def test_trajectory_rejects_bad_args(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        TrajectoryTable(**kw)


@pytest.mark.long
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_trajectory_table_to_offline_wandb(tok, tmp_path, monkeypatch):
    from lightning.pytorch.loggers import WandbLogger

    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        (tmp_path / var).mkdir()
        monkeypatch.setenv(var, str(tmp_path / var))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(offline=True, save_dir=str(tmp_path / "wandb_run"), project="cope-test")
    try:
        ep = make_episode(tok, [("look", True, 1.0, "goal reached", "")], success=True)
        trainer = fake_trainer(tmp_path / "run", episodes=[ep], loggers=[logger])
        TrajectoryTable().on_train_epoch_end(trainer, SimpleNamespace(policy=SimpleNamespace(tokenizer=tok)))
        assert read_jsonl(tmp_path / "run" / "trajectories.jsonl")[0]["observation"] == "goal reached"
    finally:
        logger.experiment.finish()
    (table,) = (tmp_path / "wandb_run").rglob("media/table/rollout/trajectories_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"] == COLUMNS and logged["data"][0][COLUMNS.index("observation")] == "goal reached"


# ---------------------------------------------------------------- SampleEfficiency


def _counters(n):
    return {"episodes": 8 * n, "env_steps": 40 * n, "generated_tokens": 400 * n, "train_tokens": 1000 * n}


def _epoch(cb, trainer, epoch, rollout, val):
    trainer.current_epoch, trainer.global_step = epoch, 4 * (epoch + 1)
    trainer.datamodule.counters = _counters(epoch + 1)
    trainer.callback_metrics["rollout/success"] = torch.tensor(rollout)
    cb.on_train_epoch_end(trainer, None)
    trainer.callback_metrics.update({"val/success": torch.tensor(val), "val/score": torch.tensor(val + 0.05)})
    cb.on_validation_end(trainer, None)


def test_sample_efficiency_rows_threshold_files_and_resume(tmp_path):
    logger = Recorder()
    trainer = fake_trainer(tmp_path, loggers=[logger])
    cb = SampleEfficiency(threshold=0.5)
    trainer.sanity_checking = True
    trainer.callback_metrics["val/success"] = torch.tensor(1.0)
    cb.on_validation_end(trainer, None)  # the sanity check is not a measurement
    assert cb.val_rows == [] and logger.metrics == []
    trainer.sanity_checking = False
    _epoch(cb, trainer, 0, 0.125, 0.25)
    assert cb.reached is None and logger.metrics == []
    _epoch(cb, trainer, 1, 0.375, 0.75)
    # "epoch" lets a resumed run drop the row when that epoch is run again (ResumableCSVLogger.rewind)
    assert logger.metrics == [({"efficiency/episodes_to_threshold": 16, "efficiency/env_steps_to_threshold": 80, "epoch": 1}, 8)]
    assert logger.saved == 1  # saved when logged: a kill right after loses no row
    _epoch(cb, trainer, 2, 0.5, 1.0)
    assert len(logger.metrics) == 1  # logged once
    with (tmp_path / "learning_curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["episodes"] for r in rows] == ["8", "16", "24"] and rows[1]["env_steps"] == "80"
    assert float(rows[1]["val_success"]) == 0.75 and float(rows[1]["val_score"]) == pytest.approx(0.8)
    assert list(rows[0]) == ["epoch", "global_step", "episodes", "env_steps", "generated_tokens", "train_tokens",
                             "val_success", "val_score"]
    with (tmp_path / "learning_curve_train.csv").open() as f:
        train = list(csv.DictReader(f))
    assert [float(r["rollout_success"]) for r in train] == [0.125, 0.375, 0.5]
    assert (tmp_path / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC
    # resume: the state survives a (weights-only) checkpoint round trip and keeps the whole curve
    buf = io.BytesIO()
    torch.save(cb.state_dict(), buf)
    buf.seek(0)
    resumed = SampleEfficiency(threshold=0.5)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.val_rows == cb.val_rows and resumed.train_rows == cb.train_rows
    assert resumed.reached == {"episodes": 16, "env_steps": 80, "global_step": 8}
    (tmp_path / "learning_curve.png").unlink()
    _epoch(resumed, trainer, 3, 0.75, 0.9)
    assert len(logger.metrics) == 1 and len(resumed.val_rows) == 4  # not logged again after resume
    with (tmp_path / "learning_curve.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 4
    resumed.on_fit_end(trainer, None)
    assert (tmp_path / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC


def test_sample_efficiency_falls_back_to_episodes_and_respects_rank(tmp_path):
    eps = [SimpleNamespace(success=s) for s in (True, False, False, False)]
    trainer = fake_trainer(tmp_path / "a", episodes=eps, val_episodes=eps[:2], is_global_zero=False, counters=_counters(1))
    cb = SampleEfficiency(threshold=0.5, plot=False, filename="curve")
    cb.on_train_epoch_end(trainer, None)
    cb.on_validation_end(trainer, None)
    assert cb.train_rows[0]["rollout_success"] == 0.25
    assert cb.val_rows[0]["val_success"] == 0.5 and cb.val_rows[0]["val_score"] is None
    assert cb.reached["episodes"] == 8  # every rank keeps the same state
    assert not (tmp_path / "a").exists()  # but only rank zero writes
    trainer.is_global_zero = True
    cb.on_validation_end(trainer, None)
    cb.on_fit_end(trainer, None)
    assert (tmp_path / "a" / "curve.csv").exists() and not (tmp_path / "a" / "curve.png").exists()  # plot=False
    assert cb.state_key != SampleEfficiency().state_key  # two instances do not share a checkpoint slot


@pytest.mark.parametrize("kw", [{"threshold": 0.0}, {"threshold": 1.5}, {"threshold": "0.5"}, {"filename": ""}, {"filename": "a/b"}])
def test_sample_efficiency_rejects_bad_args(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SampleEfficiency(**kw)


# ---------------------------------------------------------------- AdapterExport


@pytest.fixture(scope="module")
def tiny_policy(tok, tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    base_dir = tmp_path_factory.mktemp("base")
    Qwen2ForCausalLM(cfg).save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    model = get_peft_model(Qwen2ForCausalLM.from_pretrained(base_dir), LoraConfig(r=4, target_modules="all-linear"))
    with torch.no_grad():  # lora_B starts at zero: make the adapter matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return SimpleNamespace(model=model.eval(), tokenizer=tok, source=str(base_dir), finetune="lora")


def test_adapter_export_loads_with_plain_peft(tiny_policy, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = fake_trainer(tmp_path, counters=_counters(2), current_epoch=1, global_step=9)
    cb = AdapterExport()
    cb.on_train_epoch_end(trainer, SimpleNamespace(policy=tiny_policy))  # every_n_epochs=0: nothing yet
    assert not (tmp_path / "adapter").exists()
    cb.on_fit_end(trainer, SimpleNamespace(policy=tiny_policy))
    out = tmp_path / "adapter"
    assert (out / "adapter_config.json").exists() and (out / "tokenizer.json").exists()
    meta = json.loads((out / "cope_export.json").read_text())
    assert meta["base_model"] == tiny_policy.source and meta["counters"] == _counters(2)
    assert meta["epoch"] == 1 and meta["global_step"] == 9
    x = torch.tensor([[5, 6, 7, 8, 9]])
    base = AutoModelForCausalLM.from_pretrained(tiny_policy.source)
    with torch.no_grad():
        base_logits = base(x).logits
        loaded = PeftModel.from_pretrained(base, str(out)).eval()
        torch.testing.assert_close(loaded(x).logits, tiny_policy.model(x).logits)
    assert not torch.allclose(base_logits, tiny_policy.model(x).logits.detach())  # the adapter was applied
    assert AutoTokenizer.from_pretrained(out).encode("go north", add_special_tokens=False) == ids(tiny_policy.tokenizer, "go north")


def test_adapter_export_every_n_epochs_and_rank_zero(tiny_policy, tmp_path):
    cb = AdapterExport(dirname="lora", every_n_epochs=2)
    pl_module = SimpleNamespace(policy=tiny_policy)
    for epoch in range(4):
        cb.on_train_epoch_end(fake_trainer(tmp_path, current_epoch=epoch), pl_module)
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["epoch_1", "epoch_3"]
    assert (tmp_path / "lora" / "epoch_3" / "adapter_model.safetensors").exists()
    cb.on_fit_end(fake_trainer(tmp_path / "other", is_global_zero=False), pl_module)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("kw", [{"dirname": ""}, {"dirname": "/abs"}, {"dirname": "../up"}, {"every_n_epochs": -1}])
def test_adapter_export_rejects_bad_args(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        AdapterExport(**kw)


# ---------------------------------------------------------------- Throughput


def test_count_tokens_2d_and_4d():
    assert int(count_tokens({"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])})) == 5
    # one row: transcript of 3 at columns 0-2, a forecast segment at 3-4 anchored after column 1, 2 pads
    allowed = torch.zeros(1, 7, 7, dtype=torch.bool)
    allowed[0, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
    allowed[0, 3:5, :2] = True
    allowed[0, 3:5, 3:5] = torch.ones(2, 2, dtype=torch.bool).tril()
    allowed[0, 5, 5] = allowed[0, 6, 6] = True
    mask = torch.zeros(1, 1, 7, 7).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
    assert int(count_tokens({"attention_mask": mask, "position_ids": torch.tensor([[0, 1, 2, 2, 3, 0, 0]])})) == 5
    assert count_tokens([torch.zeros(2)]) is None and count_tokens({"input_ids": torch.zeros(2, 2)}) is None


def test_throughput_times_the_optimizer_part_without_validation(monkeypatch):
    import cope.callbacks.throughput as tp

    clock = iter([10.0, 14.0, 15.0, 20.0])  # first batch, val start, val end, epoch end
    monkeypatch.setattr(tp, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    cb, rec = Throughput(), Recorder()
    trainer = SimpleNamespace(sanity_checking=False)
    cb.on_train_epoch_start(trainer, rec)
    for i in range(2):
        batch = {"attention_mask": torch.ones(2, 10, dtype=torch.long)}
        cb.on_train_batch_start(trainer, rec, batch, i)
        cb.on_train_batch_end(trainer, rec, None, batch, i)
    cb.on_validation_start(trainer, rec)
    cb.on_validation_end(trainer, rec)
    cb.on_train_epoch_end(trainer, rec)
    got = {name: (value, kw) for name, value, kw in rec.logged}
    assert got["perf/epoch_seconds"][0] == 9.0  # 10 s minus 1 s of validation
    assert got["perf/train_tokens_per_s"][0] == pytest.approx(40 / 9.0)
    assert got["perf/train_tokens_per_s"][1]["on_epoch"] and got["perf/train_tokens_per_s"][1]["reduce_fx"] == "sum"
    # an epoch without batches still logs (every rank must join the sync), as zeros
    rec.logged.clear()
    cb.on_train_epoch_start(trainer, rec)
    cb.on_train_epoch_end(trainer, rec)
    assert [(n, v) for n, v, _ in rec.logged] == [("perf/epoch_seconds", 0.0), ("perf/train_tokens_per_s", 0.0)]


# ---------------------------------------------------------------- all four in a tiny real fit


def test_callbacks_in_a_tiny_lightning_fit(tok, tiny_policy, tmp_path):
    """Hook legality (``self.log`` only where Lightning allows it), ``trainer.log_dir`` resolution, and
    metrics the module logs in its own ``on_validation_epoch_end`` (which runs after the callbacks')."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    class DataModule(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.counters = {"episodes": 0, "env_steps": 0, "generated_tokens": 0, "train_tokens": 0}
            self.train_record = self.val_record = None

        def train_dataloader(self):
            self.train_record = epoch_record([make_episode(tok, [("look", i % 2 == 0, 0.0, "a wall", "")], success=i == 0,
                                                           index=i) for i in range(4)], self.counters)
            self.counters["episodes"] += 4
            self.counters["env_steps"] += 4
            batch = {"x": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
            return DataLoader([batch] * 3, batch_size=None)

        def val_dataloader(self):
            return DataLoader([{"x": torch.ones(1, 3)}], batch_size=None)

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.policy = tiny_policy

        def training_step(self, batch, batch_idx):
            self.log("rollout/success", 0.25 + 0.5 * self.current_epoch, on_epoch=True, batch_size=1)
            return self.lin(batch["x"]).pow(2).mean()

        def validation_step(self, batch, batch_idx):
            pass

        def on_validation_epoch_end(self):
            self.log("val/success", 0.6 + 0.1 * self.current_epoch)
            self.log("val/score", 1.0)

        def configure_optimizers(self):
            return torch.optim.SGD(self.lin.parameters(), lr=0.1)

    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                         callbacks=[Throughput(), AdapterExport(), SampleEfficiency(threshold=0.65), TrajectoryTable(num_episodes=2)],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=1)
    trainer.fit(Module(), datamodule=DataModule())
    run = tmp_path / "lightning_logs" / "version_0"
    rows = read_jsonl(run / "trajectories.jsonl")
    assert [(r["epoch"], r["episode"], r["valid"]) for r in rows] == [(0, 0, True), (0, 1, False), (1, 0, True), (1, 1, False)]
    with (run / "learning_curve.csv").open() as f:
        val = list(csv.DictReader(f))
    assert [r["episodes"] for r in val] == ["4", "8"]
    assert [float(r["val_success"]) for r in val] == pytest.approx([0.6, 0.7])  # this run's values, not stale ones
    with (run / "learning_curve_train.csv").open() as f:
        assert [float(r["rollout_success"]) for r in csv.DictReader(f)] == pytest.approx([0.25, 0.75])
    assert (run / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC
    with (run / "metrics.csv").open() as f:
        metrics = list(csv.DictReader(f))
    assert [r["efficiency/episodes_to_threshold"] for r in metrics if r.get("efficiency/episodes_to_threshold")] == ["8"]
    tps = [float(r["perf/train_tokens_per_s"]) for r in metrics if r.get("perf/train_tokens_per_s")]
    assert len(tps) == 2 and all(t > 0 for t in tps)
    assert json.loads((run / "adapter" / "cope_export.json").read_text())["counters"]["episodes"] == 8
