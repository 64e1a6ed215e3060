"""Sharded training (``trainer=fsdp``, FSDP2 on gloo) with 2 CPU processes through the real entry point, against
``trainer=ddp`` on the same config and seed.

What each run writes (:class:`FSDPTrace`, loaded into the ``train.py`` subprocesses with ``PYTHONPATH=<tests>``): every
rank's sampled token ids per epoch, the parameters each rank holds during an optimizer step, and the whole adapter after
fit (gathered from the shards under FSDP). The two runs must sample the same tokens (the rollouts see whole weights,
bit-identical to DDP's), and log the same losses and metrics within fp32 noise: the gradients are the same sums, reduced
in another order (a reduce-scatter of each layer's shards with FSDP's pre/post division, against DDP's bucketed
all-reduce), and the global norm sums per-shard partial sums; each is a few ulp apart. Measured: the GRPO run is bit
for bit DDP's, the CoPE run differs in ``forecast/grad_norm`` by 9e-8 relative. 1e-6 relative (1e-10 absolute: the
losses here are ~1e-8) leaves a 10x margin and fails on any real error (a shard-local norm, a wrong clip, a gradient
not reduced, a missing adapter shard).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from cope.train.objectives import batch_kind

TESTS = Path(__file__).resolve().parent
# a warm-started model on small mazes finishes some episodes (groups with a signal: non-zero gradients); one
# validation (after the last epoch) on a small panel, split 2/2 over the ranks
FAST = ["debug=fast", "trainer.devices=2", "trainer.accelerator=cpu", "model.warm_start_steps=150", "env.sizes=[5]",
        "env.min_distance=1", "validate_before_fit=false", "data.val_tasks=4", "trainer.check_val_every_n_epoch=2"]
REL, ABS = 1e-6, 1e-10  # fp32 reduction-order noise (module doc); the losses are ~1e-8 here, so ABS stays below
TIMING = ("perf/", "epoch", "step")  # wall-clock columns and the row index


class FSDPTrace(Callback):
    """Test-only: ``<out>/rank<r>.jsonl`` rows ``{"epoch": e, "tokens": [...]}`` (every episode's token ids) and
    ``{"held": {...}}`` (:func:`cope.train.fsdp.sharding.parameter_counts` during the first step), ``{"parts": n, "kind": k}``
    (each step's micro-batch count and batch kind), and ``<out>/adapter.pt``
    (rank zero: the trainable tensors, whole) at the end of fit; ``<out>/kept.ckpt``: a copy of the checkpoint as it was
    at the start of epoch ``keep_checkpoint_at_epoch``."""

    def __init__(self, out: str, keep_checkpoint_at_epoch: int = -1):
        self.out, self.keep_at = Path(out), int(keep_checkpoint_at_epoch)
        self.counted = False

    def _write(self, trainer, row: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        from cope.records import train_record

        self._write(trainer, {"epoch": trainer.current_epoch, "tokens": [list(e.tokens) for e in train_record(trainer).episodes]})
        if trainer.current_epoch == self.keep_at and trainer.is_global_zero:  # the previous epoch's checkpoint
            last = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"  # a file, or a sharded folder
            (shutil.copytree if last.is_dir() else shutil.copy)(last, self.out / "kept.ckpt")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from cope.train.fsdp.sharding import parameter_counts

        self._write(trainer, {"parts": len(pl_module.micro_batches(batch)), "kind": batch_kind(batch)})
        if not self.counted:  # callbacks run before the module's hook: the weights are still sharded here
            self.counted = True
            self._write(trainer, {"held": parameter_counts(pl_module.model),
                                  "checkpoint_io": type(trainer.strategy.checkpoint_io).__name__})

    def on_fit_end(self, trainer, pl_module) -> None:
        from cope.train.fsdp.sharding import whole_trainable_state

        state = whole_trainable_state(pl_module.policy)  # a collective under FSDP
        if state is None:
            state = {n: p.detach().clone() for n, p in pl_module.policy.model.named_parameters() if p.requires_grad}
        if trainer.is_global_zero:
            torch.save(state, self.out / "adapter.pt")


def _run(train_script, tmp_path: Path, name: str, trainer: str, extra: list[str] = ()):
    run_dir, out = tmp_path / name, tmp_path / f"{name}_trace"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)}
    proc = train_script([*FAST, f"trainer={trainer}", f"hydra.run.dir={run_dir}",
                         "+callbacks.fsdp_trace._target_=test_fsdp.FSDPTrace", f"+callbacks.fsdp_trace.out={out}", *extra],
                        tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, f"{trainer}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    rows = [[json.loads(x) for x in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]
    return run_dir, rows, torch.load(out / "adapter.pt"), proc


def _pair(train_script, tmp_path: Path, extra: list[str] = (), fsdp_extra: list[str] = ()) -> dict:
    """Runs ddp and fsdp with ``extra`` (and the fsdp run also ``fsdp_extra``): each run's (dir, rows, adapter, proc)."""
    return {t: _run(train_script, tmp_path, t, t, [*extra, *(fsdp_extra if t == "fsdp" else ())]) for t in ("ddp", "fsdp")}


def _agree(pair: dict, read_metrics, epochs: int, adapter_abs: float = ABS, every_step: bool = True,
           logged: tuple[str, ...] = ("loss/total", "train/grad_norm", "policy/approx_kl")) -> dict:
    """Asserts the pair's ddp and fsdp runs agree (the adapters within ``adapter_abs``); returns the fsdp run's facts.
    ``every_step``: every optimizer step had a gradient (else: at least one); ``logged``: metrics both runs must log."""
    ddp_dir, ddp_rows, ddp_adapter, _ = pair["ddp"]
    fs_dir, fs_rows, fs_adapter, proc = pair["fsdp"]
    for r in range(2):  # the same episodes, token for token, on each rank and epoch
        tokens = [[x["tokens"] for x in rows[r] if "tokens" in x] for rows in (ddp_rows, fs_rows)]
        assert len(tokens[0]) == epochs and tokens[0] == tokens[1], f"rank {r}: the sampled tokens differ"
    assert fs_rows[0][0]["tokens"] != fs_rows[1][0]["tokens"]  # the premise: the ranks sample their own episodes
    a, b = read_metrics(ddp_dir / "csv" / "metrics.csv"), read_metrics(fs_dir / "csv" / "metrics.csv")
    assert set(a) == set(b), set(a) ^ set(b)
    compared = [k for k in a if not k.startswith(TIMING)]
    for k in compared:
        assert b[k] == pytest.approx(a[k], rel=REL, abs=ABS), (k, a[k], b[k])
    assert set(logged) <= set(compared), set(logged) - set(compared)
    assert (min if every_step else max)(a["train/grad_norm"]) > 0 and len(a["loss/total"]) >= 2
    assert set(ddp_adapter) == set(fs_adapter) and ddp_adapter
    for k in ddp_adapter:  # the whole adapter after fit, gathered from the shards
        torch.testing.assert_close(fs_adapter[k], ddp_adapter[k], rtol=REL, atol=adapter_abs)
    ddp_held = [x["held"] for x in ddp_rows[0] if "held" in x][0]
    held = [[x["held"] for x in rows if "held" in x][0] for rows in fs_rows]
    parts = [[(x["parts"], x["kind"]) for x in rows if "parts" in x] for rows in fs_rows]
    return {"held": held, "ddp_held": ddp_held, "stderr": proc.stderr + proc.stdout, "dir": fs_dir, "parts": parts,
            "metrics": b}


def _half_each(got: dict) -> None:
    """Under DDP every rank holds every parameter; under FSDP each rank half of each (the tied embedding and head one
    tensor), nothing whole on every rank, and the two halves partition them."""
    full = got["ddp_held"]["full"]  # every parameter once (the tiny model ties its head to the embedding)
    assert got["ddp_held"]["local"] == full and got["ddp_held"]["replicated"] == full
    for h in got["held"]:
        assert h["replicated"] == 0 and h["full"] == full, h
        assert abs(h["local"] - full / 2) <= 64, h  # half (row-split rounding)
    assert sum(h["local"] for h in got["held"]) == full


# the LoRA pair, shared by the agreement, resume and refusal tests below (each launch costs ~20 s): 3 epochs, the KL to
# the adapter-disabled reference on, a validation before fit (it leaves the weights gathered when the optimizer is
# built), the checkpoint written after epoch 2 kept for the resume
LORA = ["algo=grpo", "algo.objectives.kl.weight=0.05", "validate_before_fit=true", "trainer.max_epochs=3"]


@pytest.fixture(scope="module")
def lora_pair(train_script, tmp_path_factory):
    return _pair(train_script, tmp_path_factory.mktemp("lora"), [*LORA, "+callbacks.fsdp_trace.keep_checkpoint_at_epoch=2"])


@pytest.mark.long
@pytest.mark.ddp
def test_fsdp_matches_ddp_with_lora(lora_pair, read_metrics):
    """trainer=fsdp against trainer=ddp (2 ranks each, LoRA, 3 epochs, the KL to the adapter-disabled reference on): the
    same sampled tokens, the same losses and metrics and the same adapter within fp32 noise; each rank holds half of
    every sharded parameter during a step."""
    got = _agree(lora_pair, read_metrics, epochs=3)
    assert "loss/kl" in got["metrics"] and max(got["metrics"]["loss/kl"]) > 0  # the adapter-disabled reference ran
    _half_each(got)
    assert got["stderr"].count("trainer=fsdp: rank") == 2  # sharded once per rank (not again after the validation)
    # the export and the checkpoint hold the whole adapter (not rank zero's shards)
    from safetensors.torch import load_file
    exported = load_file(str(got["dir"] / "csv" / "adapter" / "adapter_model.safetensors"))
    ckpt = torch.load(got["dir"] / "checkpoints" / "last.ckpt", weights_only=True)
    lora = {k: v for k, v in ckpt["state_dict"].items() if "lora_" in k}
    assert lora and len(exported) == len(lora)
    assert sorted(v.shape for v in exported.values()) == sorted(v.shape for v in lora.values())


@pytest.mark.long
@pytest.mark.ddp
def test_fsdp_matches_ddp_with_cope_separate_steps(train_script, read_metrics, tmp_path):
    """algo=cope (its separate forecast optimizer steps), a token budget that cuts the minibatches into micro-batches
    (ranks with different counts run that step gathered), shared-prefix attention and activation checkpointing, with
    the gradients reduce-scattered after every micro-batch (``sync_every_microbatch``; in the gathered steps the ranks
    with fewer micro-batches pad with zero-gradient passes: a reduce-scatter per micro-batch was a different number of
    collectives on each rank, a deadlock): trainer=fsdp agrees with trainer=ddp as above."""
    pair = _pair(train_script, tmp_path, ["algo=cope", "module.max_tokens_per_microbatch=256", "data.share_prefix=true",
                                          "model.gradient_checkpointing=true"],
                 fsdp_extra=["trainer.strategy.sync_every_microbatch=true"])
    # reduce-scattered per micro-batch, the ranks' gradients are added in more pieces than DDP's one all-reduce, and
    # Adam divides each entry's gradient by its own running scale, so an entry whose gradient nearly cancels carries
    # that rounding into its update: measured 1.5e-10 here and 5.9e-9 on CI's CPU (an entry of 2.7e-4). The bound is
    # 1e-4 of one step (lr = 1e-3): 17x the worst seen; a real error (a gradient not reduced, a wrong clip) is ~lr
    got = _agree(pair, read_metrics, epochs=2, adapter_abs=1e-7)
    assert len(got["metrics"]["forecast/loss_total"]) >= 2  # separate forecast steps ran (and agreed above)
    steps = list(zip(*got["parts"]))  # ((rank 0's count, kind), (rank 1's ...)) per step
    assert {k for (_, k), _ in steps} == {"rollout", "forecast"}, steps
    # the premise of both paths: a step the ranks cut alike into several micro-batches (sharded forwards) and one they
    # cut differently (gathered for the step)
    assert any(a == b > 1 for (a, _), (b, _) in steps) and any(a != b for (a, _), (b, _) in steps), steps
    assert "every rank running as many backward passes (sync_every_microbatch)" in got["stderr"]


@pytest.mark.slow
@pytest.mark.ddp
def test_fsdp_matches_ddp_with_branched_rollouts(train_script, read_metrics, tmp_path):
    """+collector=branching (trees grown with the whole weights gathered, their groups trained as tries): trainer=fsdp
    agrees with trainer=ddp in the trees' tokens on each rank, every metric (the rollout/branch_* costs included) and
    the adapter."""
    # a tree's leaves share their outcome more often than independent episodes: a step may meet no reward spread
    pair = _pair(train_script, tmp_path, ["+collector=branching", "data.share_prefix=true", "data.group_size=8",
                                          "data.tasks_per_epoch=4", "data.minibatch_size=16"])
    got = _agree(pair, read_metrics, epochs=2, every_step=False)
    assert min(got["metrics"]["rollout/branch_forks"]) > 0
    assert all(a < b for a, b in zip(got["metrics"]["rollout/branch_env_steps"],
                                      got["metrics"]["rollout/branch_flat_env_steps_est"]))


@pytest.mark.long
@pytest.mark.ddp
def test_fsdp_matches_ddp_with_full_finetuning(train_script, read_metrics, tmp_path):
    """model.finetune=full with algo=cope (its separate forecast steps on the same optimizer) and the KL to the frozen
    reference copy: trainer=fsdp agrees with trainer=ddp (the same global batch) in sampled tokens, every metric and
    every trained weight; each rank holds half of every parameter (the tied embedding and head included)."""
    pair = _pair(train_script, tmp_path, ["model.finetune=full", "algo=cope", "algo.objectives.kl.weight=0.05",
                                          "module.optimizer.lr=1e-4"])
    got = _agree(pair, read_metrics, epochs=2)
    _half_each(got)
    weights = pair["fsdp"][2]
    assert any("embed_tokens" in k for k in weights) and not any("lora_" in k for k in weights)
    assert len(got["metrics"]["forecast/loss_total"]) >= 1 and max(got["metrics"]["loss/kl"]) > 0
    assert (got["dir"] / "csv" / "model" / "config.json").is_file()  # the export: the whole model, gathered


@pytest.mark.parametrize("override,key", [
    ("model.quantization=4bit", "model.quantization"),
    ("rollout=vllm", "data.engine"),
    ("callbacks.adapter_export.merged=true", "callbacks.adapter_export.merged"),
    ("callbacks.grad_stats.every_n_steps=2", "callbacks.grad_stats.every_n_steps"),
])
def test_fsdp_refuses_what_cannot_be_sharded(compose, tmp_path, override, key):
    """Each refusal comes from the config check (before any work), names the key and a fix; the same setting under
    trainer=ddp passes the sharding rule."""
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose(["trainer=fsdp", override], tmp_path))
    msg = str(err.value)
    assert key in msg and "trainer=fsdp" in msg and ("use " in msg.lower() or "set it" in msg), msg
    try:
        check_config(compose(["trainer=ddp", override], tmp_path))
    except ConfigError as e:  # another rule may refuse it on this machine (no bitsandbytes, no vLLM), not this one
        assert "trainer=fsdp" not in str(e), str(e)


@pytest.mark.long
@pytest.mark.ddp
def test_fsdp_resume_equals_the_straight_run(lora_pair, train_script, tmp_path):
    """trainer=fsdp: a resume to 3 epochs from the checkpoint written after 2 equals the straight 3-epoch run: the
    third epoch's sampled tokens and the final adapter, bit for bit. The checkpoint is one file holding the whole
    adapter (every trainable tensor, none of the frozen base) and the optimizer's moments for each of them."""
    straight_dir, straight_rows, straight_adapter, _ = lora_pair["fsdp"]
    kept = straight_dir.parent / "fsdp_trace" / "kept.ckpt"  # written after epoch 1: what a 2-epoch run leaves
    ckpt = torch.load(kept, weights_only=True)
    assert ckpt["epoch"] == 1 and ckpt["state_dict"] and all("lora_" in k for k in ckpt["state_dict"])
    moments = ckpt["optimizer_states"][0]["state"]  # keyed by parameter name
    assert set(moments) == set(ckpt["state_dict"])
    assert [x["checkpoint_io"] for x in straight_rows[0] if "held" in x] == ["AtomicCheckpointIO"]  # written atomically
    assert all(v["exp_avg"].shape == ckpt["state_dict"][k].shape for k, v in moments.items())
    _, resumed_rows, adapter, _ = _run(train_script, tmp_path, "resumed", "fsdp", [*LORA, f"ckpt_path={kept}"])
    for r in range(2):
        straight = [x["tokens"] for x in straight_rows[r] if "tokens" in x]
        resumed = [x["tokens"] for x in resumed_rows[r] if "tokens" in x]
        assert len(straight) == 3 and resumed == straight[2:], r  # the resumed run collected epoch 2 only, the same
    assert adapter.keys() == straight_adapter.keys() and all(torch.equal(adapter[k], straight_adapter[k]) for k in adapter)


@pytest.mark.long
def test_fsdp_resumes_at_another_world_size(lora_pair, train_script, read_metrics, tmp_path):
    """The 2-process checkpoint (whole tensors keyed by name) resumes in one process: the epoch after it trains and the
    counters continue, and the log says the episodes from here on are not the 2-process run's."""
    kept = lora_pair["fsdp"][0].parent / "fsdp_trace" / "kept.ckpt"
    ckpt = torch.load(kept, weights_only=True)
    assert ckpt["world_size"] == 2
    run_dir = tmp_path / "one"
    proc = train_script([*FAST, *LORA, "trainer=fsdp", "trainer.devices=1", f"hydra.run.dir={run_dir}",
                         f"ckpt_path={kept}"], tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "written by 2 processes on 1" in out and "rank 0 holds" in out, out[-4000:]
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert len(cols["loss/total"]) >= 1 and min(cols["train/grad_norm"]) > 0
    before = ckpt["RolloutDataModule"]["counters"]["episodes"]  # both ranks' two epochs
    assert cols["counters/episodes"][-1] == before + before / 4, (cols["counters/episodes"], before)  # + one rank's one


@pytest.mark.slow
@pytest.mark.ddp
def test_fsdp_distributed_checkpoint_resumes_exactly_at_any_world_size(lora_pair, train_script, read_metrics, tmp_path):
    """trainer.strategy.distributed_checkpoint=true: last.ckpt is a torch distributed checkpoint folder (each rank's
    shards, meta.pt written last, no leftovers). The run equals the single-file run bit for bit; its checkpoint after
    epoch 2 holds the same tensors as the single-file one (eval's reader: one process, no process group); it resumes in
    one process (resharded on load). A 2-process resume equal to the straight run, after a SIGKILL:
    tests/test_ddp_resume.py."""
    from cope.train.fsdp.checkpoint import is_sharded_checkpoint, load_trained_tensors

    dcp = [*LORA, "trainer.strategy.distributed_checkpoint=true"]
    run_dir, _, adapter, _ = _run(train_script, tmp_path, "dcp", "fsdp", [*dcp, "+callbacks.fsdp_trace.keep_checkpoint_at_epoch=2"])
    straight_adapter = lora_pair["fsdp"][2]
    assert adapter.keys() == straight_adapter.keys() and all(torch.equal(adapter[k], straight_adapter[k]) for k in adapter)
    last = run_dir / "checkpoints" / "last.ckpt"
    assert is_sharded_checkpoint(last) and len(list(last.glob("*.distcp"))) == 2
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no .tmp-dcp or .old left
    kept, file_kept = tmp_path / "dcp_trace" / "kept.ckpt", lora_pair["fsdp"][0].parent / "fsdp_trace" / "kept.ckpt"
    single = torch.load(file_kept, weights_only=True)["state_dict"]
    read = load_trained_tensors(kept, {k: v for k, v in single.items()})
    assert read.keys() == single.keys() and all(torch.equal(read[k], single[k]) for k in single)
    one = tmp_path / "one"
    proc = train_script([*FAST, *dcp, "trainer=fsdp", "trainer.devices=1", f"hydra.run.dir={one}", f"ckpt_path={kept}"],
                        tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "written by 2 processes on 1" in out, out[-4000:]
    assert len(read_metrics(one / "csv" / "metrics.csv")["loss/total"]) >= 1


@pytest.mark.long
@pytest.mark.ddp
def test_fsdp_refuses_a_ddp_checkpoint(lora_pair, train_script, tmp_path):
    """A checkpoint written under trainer=ddp (optimizer state keyed by index) is refused by a trainer=fsdp resume with
    the file and the fix, before any model is built or process launched (not loaded into the wrong moments)."""
    ckpt = lora_pair["ddp"][0] / "checkpoints" / "last.ckpt"
    assert all(isinstance(k, int) for k in torch.load(ckpt, weights_only=True)["optimizer_states"][0]["state"])
    proc = train_script([*FAST, *LORA, "trainer=fsdp", "trainer.max_epochs=4", f"hydra.run.dir={tmp_path / 'fsdp'}",
                         f"ckpt_path={ckpt}"], tmp_path, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "written under trainer=ddp" in out and "this run is trainer=fsdp" in out, out[-4000:]
    assert "trainer it was trained with" in out and "policy " not in out and "Starting with 2 processes" not in out, out
    assert not (tmp_path / "fsdp" / "checkpoints").exists()


@pytest.mark.parametrize("mode", ["lora_on_lm_head", "full"])
def test_sharded_model_scores_and_trains_its_head(tmp_path, mode):
    """The output head (and the tied embedding) are sharded in the root group and read inside the LM's forward, so a
    trained head shards too: LoRA on lm_head (the model's own logits) and full fine-tuning (the chunked path with the
    head's gradient). Sharded (one gloo process: every gather and free still runs), the log-probs and every gradient
    equal the unsharded model's."""
    import copy

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cope.train.fsdp.sharding import shard_policy
    from cope.train.logprobs import causal_lm_logprobs

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=mode == "full")
    model = Qwen2ForCausalLM(cfg)
    if mode == "lora_on_lm_head":
        model = get_peft_model(model.requires_grad_(False), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask, pos = torch.ones_like(ids), torch.arange(9).expand(2, 9)
    weights = torch.randn(2, 9, generator=torch.Generator().manual_seed(2))

    def grads(m):
        lp, _ = causal_lm_logprobs(m, ids, mask, pos, tempered=mask.bool(), temperature=0.7, chunk_elems=3 * 64)
        (lp * weights).sum().backward()
        out = {}
        for n, p in m.named_parameters():
            if p.requires_grad:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                out[n.replace("_checkpoint_wrapped_module.", "")] = g
        return lp.detach(), out

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        counts = shard_policy(model, init_device_mesh("cpu", (1,)))
        assert counts["replicated"] == 0 and counts["local"] == counts["full"]  # one rank: its shard is everything
        want_lp, want = grads(plain)
        got_lp, got = grads(model)
    finally:
        dist.destroy_process_group()
    torch.testing.assert_close(got_lp, want_lp)
    assert set(got) == set(want) and any("lm_head" in n or "embed_tokens" in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], msg=n)
