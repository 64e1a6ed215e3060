"""Per-rank memory you can plan with: GPU memory in each phase of a run and host RAM at setup, as formulas.

Every term is what the code holds, named where it is held (docs/sharding.md, "Memory per rank", is the prose of the
same terms; ``python -m bench.memory_plan`` prints them for a composed config). Symbols: ``P`` parameters, ``T``
trained ones (the adapter under LoRA, ``P`` under full fine-tuning), ``W`` ranks that shard (1 under DDP: nothing is
sharded), ``V`` x ``H`` the output head, ``M`` the tokens of one micro-batch (``module.max_tokens_per_microbatch``).
Trained tensors, their gradients and AdamW's moments are fp32; a frozen base is ``b`` bytes a weight (2 in bf16).

**Resident all run** (:meth:`MemoryPlan.resident`): the weights (full fine-tuning: fp32 master weights ``4P/W``;
LoRA: the base ``bP/W`` plus the adapter ``4T/W``), gradients ``4T/W``, AdamW moments ``8T/W``, and with a KL term
under full fine-tuning the frozen reference copy ``2P/W`` (bf16 under bf16 mixed precision, 4 B otherwise).

**An optimizer step** adds: the activations of one micro-batch (gradient checkpointing: each layer's input, ``2MHL``
bytes, plus the one layer recomputed in backward with its gradients, ``2M(36H + 10I)``, measured:
conf/module_for_model/qwen2.5-7b.yaml), AdamW's ``foreach`` temporary ``4T/W`` (one more fp32 tensor
per trained weight during ``optimizer.step``), the unsharded accumulated gradient ``4T`` (FSDP2 accumulates whole
gradients until the last micro-batch's reduce-scatter; not with ``sync_every_microbatch=true``, nor with one
micro-batch), a whole bf16 copy ``2P`` in a step whose ranks cut different numbers of micro-batches (it runs on
gathered weights, :func:`cope.train.fsdp.sharding.step_weights`; any step with more than one micro-batch may), and
with a trained head (full fine-tuning) the chunked log-prob backward's two fp32 ``V x H`` tensors ``8VH``
(:mod:`cope.train.logprobs`).

**Rollouts, validation and the scoring pass** add: one whole bf16 model ``2P`` gathered on every rank beside the
resident shards (the in-process engine cannot all-gather layer by layer: ranks generate different numbers of tokens),
and while generating the KV cache ``2 x 2 L Hkv D`` bytes a token for every token of the live episodes.

**Overlapped rollouts on one GPU** (``data.max_lag >= 1``, :meth:`MemoryPlan.overlapped_peak`): the rollout thread's
KV cache and sampler copies of the adapter live while the main thread's step runs: the peak is the step's plus the
KV cache plus one adapter copy per held version (``4A`` each).

**Host RAM at setup, per rank** (:meth:`MemoryPlan.host_setup`): the model is loaded on the CPU, then moved; full
fine-tuning loads fp32 (``4P``) and, with a KL term, deep-copies it for the reference before sharding (``4P`` more):
``8P`` a rank, times the ranks of a node (at 7B: 61 GB a rank, 488 GB for 8 ranks). LoRA loads ``bP``.

These are estimates that a GPU run's measured peaks check (``bench/gpu_fsdp_check.py`` prints both); the allocator's
fragmentation and CUDA's context (about 0.5-1 GiB) come on top.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes (a Hugging Face ``config.json``'s fields)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        """P: embedding (and an untied head), per layer q/k/v/o (with q/k/v biases, as Qwen2) and the MLP, norms."""
        kv = self.kv_heads * self.head_dim
        attn = self.hidden * (self.hidden + 2 * kv) + (self.hidden + 2 * kv) + self.hidden * self.hidden
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    def lora_params(self, r: int) -> int:
        """A: rank-``r`` adapters on the seven projections of every layer (the presets' target_modules)."""
        kv = self.kv_heads * self.head_dim
        pairs = [(self.hidden, self.hidden), (self.hidden, kv), (self.hidden, kv), (self.hidden, self.hidden),
                 (self.hidden, self.intermediate), (self.hidden, self.intermediate), (self.intermediate, self.hidden)]
        return self.layers * sum(r * (i + o) for i, o in pairs)


# The shapes of the models the presets name (their config.json), by model.path
SHAPES = {
    "Qwen/Qwen2.5-7B-Instruct": ModelShape(vocab=152064, hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4),
    "Qwen/Qwen2.5-14B-Instruct": ModelShape(vocab=152064, hidden=5120, intermediate=13824, layers=48, heads=40,
                                            kv_heads=8),
}


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's memory, term by term (bytes). See the module docstring for each term.

    Args:
        shape: the model.
        finetune: ``lora`` or ``full``.
        world: ranks that shard the weights (1: DDP or one device).
        lora_rank: r under LoRA.
        base_bytes: bytes a frozen base weight (2: bf16; 0.5 for 4-bit).
        kl: a KL term is on (full fine-tuning then keeps a frozen reference copy).
        bf16_compute: bf16 mixed precision (the reference is stored in bf16).
        microbatch_tokens: M (None: the whole minibatch in one forward).
        step_tokens: the tokens of one optimizer step on this rank (to count its micro-batches).
        sync_every_microbatch: the FSDP strategy's flag (no unsharded accumulated gradient).
        foreach: AdamW's multi-tensor path (its temporary).
        live_tokens: tokens of every live episode while generating (the KV cache's size).
        ranks_per_node: processes on one host (host RAM).
        held_versions: adapter copies an overlapped run holds (``data.max_lag``).
    """

    shape: ModelShape
    finetune: str = "lora"
    world: int = 1
    lora_rank: int = 16
    base_bytes: float = 2.0
    kl: bool = True
    bf16_compute: bool = True
    microbatch_tokens: int | None = None
    step_tokens: int = 16384
    sync_every_microbatch: bool = False
    foreach: bool = True
    live_tokens: int = 0
    ranks_per_node: int = 1
    held_versions: int = 0

    def __post_init__(self):
        if self.finetune not in ("lora", "full"):
            raise ValueError(f"finetune must be lora or full, got {self.finetune!r}")

    @property
    def P(self) -> int:
        return self.shape.params()

    @property
    def T(self) -> int:
        return self.P if self.finetune == "full" else self.shape.lora_params(self.lora_rank)

    @property
    def micro_batches(self) -> int:
        if self.microbatch_tokens is None:
            return 1
        return max(1, -(-self.step_tokens // self.microbatch_tokens))

    def resident(self) -> dict[str, float]:
        P, T, W = self.P, self.T, self.world
        out = {"weights": 4 * P / W if self.finetune == "full" else self.base_bytes * P / W + 4 * T / W,
               "gradients": 4 * T / W, "adamw_moments": 8 * T / W}
        if self.finetune == "full" and self.kl:
            out["kl_reference"] = (2 if self.bf16_compute else 4) * P / W
        return out

    def step(self) -> dict[str, float]:
        s, P, T, W = self.shape, self.P, self.T, self.world
        M = self.microbatch_tokens or self.step_tokens
        out = {"activations": 2 * M * s.hidden * s.layers + 2 * M * (36 * s.hidden + 10 * s.intermediate)}
        if self.foreach:
            out["adamw_foreach_temporary"] = 4 * T / W
        if W > 1 and self.micro_batches > 1:
            if not self.sync_every_microbatch:
                out["accumulated_unsharded_gradient"] = 4 * T
            out["gathered_step_weights"] = 2 * P
        if self.finetune == "full":
            out["trained_head_backward"] = 8 * s.vocab * s.hidden
        return out

    def rollout(self) -> dict[str, float]:
        s = self.shape
        out = {"whole_bf16_model": 2 * self.P} if self.world > 1 else {}
        out["kv_cache"] = 2 * 2 * s.layers * s.kv_heads * s.head_dim * self.live_tokens
        return out

    def step_peak(self) -> float:
        return sum(self.resident().values()) + sum(self.step().values())

    def rollout_peak(self) -> float:
        return sum(self.resident().values()) + sum(self.rollout().values())

    def overlapped_peak(self) -> float:
        """``data.max_lag >= 1`` on one device: the step beside the rollout's KV cache and adapter copies."""
        return self.step_peak() + self.rollout()["kv_cache"] + 4 * self.shape.lora_params(self.lora_rank) * self.held_versions

    def peak(self) -> float:
        return max(self.step_peak(), self.rollout_peak(), self.overlapped_peak() if self.held_versions else 0.0)

    def host_setup(self) -> dict[str, float]:
        """Host RAM while the model is built, per rank and for the node."""
        per_rank = 4 * self.P if self.finetune == "full" else self.base_bytes * self.P
        if self.finetune == "full" and self.kl:
            per_rank += 4 * self.P  # the reference: a deep copy of the fp32 model, before sharding
        return {"per_rank": per_rank, "per_node": per_rank * self.ranks_per_node}

    def table(self) -> str:
        """The terms in GiB, phase by phase, with the peaks."""
        lines = [f"P = {self.P / 1e9:.2f}B, T = {self.T / 1e9:.3f}B, world {self.world}, {self.micro_batches} micro-batch(es)"]
        for name, terms in (("resident", self.resident()), ("+ step", self.step()), ("+ rollout", self.rollout())):
            lines += [f"{name:10} {k:32} {v / GIB:8.2f} GiB" for k, v in terms.items()]
        lines += [f"{'peak':10} {'step':32} {self.step_peak() / GIB:8.2f} GiB",
                  f"{'peak':10} {'rollout':32} {self.rollout_peak() / GIB:8.2f} GiB"]
        if self.held_versions:
            lines.append(f"{'peak':10} {'overlapped (one device)':32} {self.overlapped_peak() / GIB:8.2f} GiB")
        host = self.host_setup()
        lines.append(f"{'host RAM':10} {'at setup, per rank / node':32} {host['per_rank'] / GIB:8.2f} / "
                     f"{host['per_node'] / GIB:.2f} GiB")
        return "\n".join(lines)
