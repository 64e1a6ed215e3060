"""The rules between config keys, checked before any work (the per-key check is :mod:`cope.run.config_check`).

Every rule about what can run with what is one row of :data:`RULES`: the keys it reads, what it needs (a capability
the class a ``_target_`` names declares, :mod:`cope.capabilities`, or a value), and a check that yields the key to
change with the message. Classes are resolved, never named (:mod:`cope.run.config_classes`): ``_target_`` with
Hydra's ``get_object``, a ``trainer.strategy`` string (``ddp``, ``fsdp``, ...) with Lightning's ``StrategyRegistry``;
callbacks are found by the class they are (``issubclass``), whatever their entry is called. So a subclass, or a class
under another name, follows the same rules (``tests/test_config_rules.py`` proves it). The rows:

* sharded weights (``trainer=fsdp``): only a strategy that gathers them whole for rollouts. Lightning's own sharding
  strategies (``trainer.strategy=fsdp``, a ``ModelParallelStrategy``, DeepSpeed) shard without that, and this
  project's sharded training (:mod:`cope.train.fsdp.sharding`) runs under its own strategy only: they are refused,
  naming ``trainer=fsdp``. No quantized weights, an engine that samples in process, no merged export, no gradient
  probes;
* full fine-tuning (``model.finetune=full``): fp32 weights, no quantization, no adapter to start from
  (:func:`cope.models.policy.finetune_problem`), an engine that samples in process, no merged export, and no
  ``trainer.precision`` that casts the weights to half precision (``bf16-true``: the master weights would be bf16);
* overlapped rollouts (``data.max_lag >= 1``): an engine that overlaps, no top-p
  (:func:`cope.train.collect.lagged.lag_problem`); from an engine that samples in process, a sampler copy per held
  version: no full fine-tuning, no sharded weights; from one that serves adapters, two LoRA slots;
* attention: flash attention cannot take CoPE's packed forecast rows (a 4D mask); shared prefixes need SDPA;
* a collector that samples plain completions (``needs_completions``: RWML's world-model predictions): an engine that
  ``completes``;
* a collector that replays the env's expert (``needs_expert``: ``algo=sft sft.source=expert``): an env class with
  ``expert_action()``;
* native tool calls (``env.action_format=native``): a model whose chat template renders tools (a model factory that
  knows its template declares ``tool_template``; else the tokenizer at ``model.path``, when it is on disk);
* a collector that branches episodes (``needs_fork``: ``+collector=branching``): an env that can ``fork()`` or
  replays deterministically (``forks_by_replay``), an engine that lends its sampling actor (``lends_actor``: in process
  or vLLM), env workers only with an env that replays;
* an objective that trains ``alone`` (``algo=echo_only``): every other objective at weight 0.

Besides the table (:func:`cross_field`): ``data.max_context`` against the model's positions
(:mod:`cope.run.context_limits`), a GPU trainer needs a GPU (``trainer=gpu`` on a machine without CUDA names
``trainer=cpu``), ``trainer.num_nodes`` x ``trainer.devices`` against the launcher's world
(:func:`cope.run.launch.check_launch`), and settings that make training a no-op are logged warnings
(``data.group_size=1``, all weights 0, ``module.optimizer.lr=0``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from omegaconf import DictConfig

from cope.capabilities import can
from cope.run.config_classes import Resolved, argument_default, resolve
from cope.run.context_limits import context_fits_model
from cope.run.launch import check_launch

Problem = Iterator[tuple[str, str]]  # (the key to change, the message after it)


@dataclass(frozen=True)
class Rule:
    """One compatibility rule.

    Attributes:
        reads: the config keys it reads (``callbacks.*``: any entry of ``callbacks`` or ``algo.callbacks``).
        needs: what it needs, in words: the capability (:mod:`cope.capabilities`) or the value.
        check: yields ``(key, message)`` for each problem (the message follows the key: `` = value: why; fix``).
    """

    reads: tuple[str, ...]
    needs: str
    check: Callable[[Resolved], Problem]


def _sharded(s: Resolved) -> bool:
    return can(s.strategy, "shards_weights")


def _lag_problem(s: Resolved) -> tuple[str, str] | None:
    """What ``data.max_lag >= 1`` needs of the engine and the sampling (None: it fits, or no lag)."""
    from cope.train.collect.lagged import lag_problem

    top_p = float((s.data.get("sampling") or {}).get("top_p", 1.0))
    return lag_problem(s.lag, s.engine, top_p) if s.lag else None


def _exports_merged(s: Resolved) -> Iterator[str]:
    """The ``merged`` keys of the adapter exports that merge (``callbacks.adapter_export.merged``)."""
    yield from (f"{key}.merged" for key, node, _ in s.entries("cope.callbacks.adapter_export.AdapterExport")
                if node.get("merged"))


def sharding_gathers(s: Resolved) -> Problem:
    if _sharded(s) and not can(s.strategy, "gathers_for_rollouts"):
        yield "trainer.strategy", (
            f" = {s.strategy_value!r}: {s.strategy.__module__}.{s.strategy.__qualname__} shards the weights, but rollouts, "
            "the scoring pass and the callbacks' probes need them whole on every rank between optimizer steps, which "
            "only this project's sharding strategy provides; use trainer=fsdp (sharded, through "
            "cope.train.fsdp.strategy.FSDPStrategy) or trainer=ddp")


def sharding_quantized(s: Resolved) -> Problem:
    quant = s.model.get("quantization")
    if _sharded(s) and quant is not None:
        yield "model.quantization", (
            f" = {quant!r}: trainer=fsdp cannot shard quantized weights (bitsandbytes packs them into its own storage, "
            "which fully_shard cannot split or gather); use model.quantization=null (the bf16 weights are sharded "
            "instead, about 1/world of them per rank) or trainer=ddp for QLoRA")


def sharding_engine(s: Resolved) -> Problem:
    if _sharded(s) and not can(s.engine, "samples_in_process"):
        yield "data.engine", (
            f" = {s.engine_target}: trainer=fsdp rolls out in-process only (rollout=hf, on the gathered weights); a "
            "server engine would be handed an adapter written from shards. Use rollout=hf, or trainer=ddp")


def sharding_merged(s: Resolved) -> Problem:
    for key in _exports_merged(s) if _sharded(s) else ():
        yield key, (" = true: trainer=fsdp does not write the merged model yet (the frozen base is sharded): set it to "
                    "false and merge the exported adapter on one process (peft's merge_and_unload), or use trainer=ddp")


def sharding_grad_stats(s: Resolved) -> Problem:
    for key, node, _ in s.entries("cope.callbacks.grad_stats.GradientStats") if _sharded(s) else ():
        if (node.get("every_n_steps") or 0) > 0:
            yield f"{key}.every_n_steps", (
                f" = {node.every_n_steps}: the gradient probes are not built for trainer=fsdp (their extra backward "
                "would run on sharded weights outside the step); set it to 0, or use trainer=ddp")


def finetune_values(s: Resolved) -> Problem:
    from cope.models.policy import finetune_problem

    m = s.model
    problem = finetune_problem(s.finetune, m.get("quantization"), m.get("adapter"), m.get("dtype", "fp32"))
    if problem is not None:
        yield problem[0], f": {problem[1]}"


def finetune_engine(s: Resolved) -> Problem:
    if s.finetune == "full" and not can(s.engine, "samples_in_process"):
        yield "data.engine", (
            f" = {s.engine_target}: model.finetune=full needs an engine that samples the trained weights in process "
            "(rollout=hf): a server engine (rollout=vllm) loads each policy version as a LoRA adapter, and pushing full "
            "weights into the server every epoch is not built. Use rollout=hf, or model.finetune=lora to keep the server")


def finetune_merged(s: Resolved) -> Problem:
    for key in _exports_merged(s) if s.finetune == "full" else ():
        yield key, (" = true with model.finetune=full: there is no adapter to merge; the export (<run>/csv/model) is "
                    "already the whole trained model. Set it to false")


HALF_TRUE = ("16-true", "bf16-true")  # Lightning's precisions that cast the weights themselves ("bf16", "16": -mixed)


def finetune_precision(s: Resolved) -> Problem:
    precision = str((s.cfg.get("trainer") or {}).get("precision", "32-true"))
    if s.finetune == "full" and precision in HALF_TRUE:
        yield "trainer.precision", (
            f" = {precision!r} with model.finetune=full: Lightning casts every weight to half precision, the fp32 master "
            "weights included, and an AdamW update under half a bf16 rounding step is then lost (at lr 1e-6 most "
            "weights would never move). Use trainer.precision=bf16-mixed (bf16 compute, fp32 weights; trainer=gpu's "
            "default) or the fsdp strategy's own mixed precision (trainer=fsdp)")


def lag_engine(s: Resolved) -> Problem:
    problem = _lag_problem(s)
    if problem is not None:
        yield problem[0], f" = {s.lag if problem[0] == 'data.max_lag' else s.data.sampling.top_p}: {problem[1]}"


def lag_sampler_copy(s: Resolved) -> Problem:
    if not s.lag or _lag_problem(s) is not None or not can(s.engine, "samples_in_process"):
        return
    if s.finetune == "full":
        yield "model.finetune", (" = full with data.max_lag >= 1 and rollout=hf: each held version would be a whole "
                                 "copy of the model (every weight trains). Use model.finetune=lora, or data.max_lag=0")
    if _sharded(s):
        yield "trainer.strategy", (
            f" = {s.strategy_value!r}: shards the weights (trainer=fsdp), and with data.max_lag >= 1 the in-process "
            "engine (rollout=hf) samples each held version from a sampler copy, which would need the whole weights "
            "gathered while the shards train. Use data.max_lag=0, or trainer=ddp")


def lag_adapter_slots(s: Resolved) -> Problem:
    if not s.lag or _lag_problem(s) is not None or not can(s.engine, "serves_adapters"):
        return
    from cope.rollout.vllm.versions import loras_problem

    engine = s.data.get("engine") or {}
    loras = engine.get("max_loras", argument_default(s.engine, "max_loras", 1))
    problem = None if engine.get("url") else loras_problem(s.lag, int(loras))  # an attached server is its operator's
    if problem is not None:
        yield "data.engine.max_loras", f" = {loras}: {problem}"


def attention_fits_packing(s: Resolved) -> Problem:
    attn = s.model.get("attn_implementation", "sdpa")
    if bool(s.data.get("share_prefix", False)) and attn not in (None, "sdpa"):
        yield "model.attn_implementation", (
            f" = {attn!r}: data.share_prefix=true forwards each GRPO group's prefix once through tree attention "
            "('cope_tree'), which runs as sdpa without a tree; use model.attn_implementation=sdpa, or "
            "data.share_prefix=false")
    if not (isinstance(attn, str) and attn.startswith("flash_attention")):
        return
    for key, node, cls in s.callbacks:
        packed = _packed_key(cls, node) if isinstance(cls, type) else None
        if packed is not None:
            yield "model.attn_implementation", (
                f" = {attn!r}: cannot take CoPE's packed forecast rows ({key}.{packed}: prefix trees, attended "
                f"through a (N, 1, T, T) mask per forward); use "
                f"{'cope.update=separate or cope.packing=plain' if packed.startswith('packing') else 'cope.packing=plain'}"
                " (2D masks only) or model.attn_implementation=sdpa")


def collector_engine(s: Resolved) -> Problem:
    collector = resolve((s.data.get("collector") or {}).get("_target_"))
    if getattr(collector, "needs_completions", False) and not can(s.engine, "completes"):
        yield "data.engine", (f" = {s.engine_target}: data.collector ({collector.__name__}) samples plain completions of "
                              "token contexts (engine.complete), which this engine cannot (no `completes` capability); "
                              "use rollout=hf or rollout=vllm")


def collector_expert(s: Resolved) -> Problem:
    node = s.data.get("collector") or {}
    collector, env = resolve(node.get("_target_")), resolve((s.cfg.get("env") or {}).get("_target_"))
    needs = getattr(collector, "needs_expert", None)
    if callable(needs) and needs(node) and isinstance(env, type) and not hasattr(env, "expert_action"):
        yield "data.collector.source", (f" = expert (sft.source): {env.__name__} has no expert_action() (the optional "
                                        "expert of cope.envs.base.Env: maze, textworld, alfworld, scienceworld); give "
                                        "demonstrations as a file instead (sft.source=file sft.path=<trajectories.jsonl>)")


def native_tools_template(s: Resolved) -> Problem:
    if (s.cfg.get("env") or {}).get("action_format") != "native":
        return
    factory, path, chosen = resolve(s.model.get("_target_")), s.model.get("path"), s.model.get("chat_template")
    declared = getattr(factory, "tool_template", None)  # a model factory that knows its own template declares it
    if chosen is not None:  # model.chat_template replaces it: a shipped one is known, a file is checked at reset
        from cope.chat.templates import RENDERS_TOOLS

        declared = RENDERS_TOOLS.get(chosen, True)
    if declared is False:
        why = "its chat template renders no tools"
    elif declared is None and isinstance(path, str):
        from cope.chat.tools import tools_problem

        try:  # the tokenizer alone, from disk or the local cache: no weights, nothing downloaded
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception:  # not on disk: the model check names model.path
            return
        why = tools_problem(tokenizer)
    else:
        return
    if why:
        yield "env.action_format", (f" = native: the env declares tools, but the chat template of the model "
                                    f"({s.model.get('_target_')}{f', {path}' if path else ''}) has no tool support "
                                    f"({why}); use env.action_format=text with this model")


def collector_forks(s: Resolved) -> Problem:
    node = s.data.get("collector") or {}
    collector, env = resolve(node.get("_target_")), resolve((s.cfg.get("env") or {}).get("_target_"))
    if not getattr(collector, "needs_fork", False):
        return
    by_copy = isinstance(env, type) and callable(getattr(env, "fork", None))
    by_replay = isinstance(env, type) and bool(getattr(env, "forks_by_replay", False))
    if isinstance(env, type) and not (by_copy or by_replay):
        yield "env", (f" = {env.__name__}: data.collector ({collector.__name__}) forks episodes mid-way, and this env can "
                      "neither fork() nor replay deterministically (forks_by_replay); use the default collector")
    problem = getattr(env, "replay_problem", None) if by_replay else None
    why = problem(dict(s.cfg.get("env") or {})) if problem else None
    if why and not by_copy:
        yield f"env.{why[0]}", (f": data.collector ({collector.__name__}) rebuilds a child's env by replay, and "
                                f"{env.__name__} does not replay deterministically so ({why[1]}); use the default collector")
        by_replay = False
    if not can(s.engine, "lends_actor"):
        yield "data.engine", (f" = {s.engine_target}: data.collector ({collector.__name__}) grows its trees with an "
                              "engine that lends its sampling actor (lends_actor: rollout=hf, rollout=vllm); this one "
                              "does not")
    workers = (s.data.get("env_runtime") or {}).get("workers", 0)
    if workers and by_copy and not by_replay:
        yield "data.env_runtime.workers", (f" = {workers}: data.collector ({collector.__name__}) rebuilds a child's env "
                                           f"in the workers by replay, and env {env.__name__} forks only by copy (fork(), "
                                           "no forks_by_replay; an env in a worker process cannot be copied); set it to 0")


def objective_alone(s: Resolved) -> Problem:
    objectives = {name: node for name, node in (s.cfg.get("algo") or {}).get("objectives", {}).items() if node is not None}
    for name, node in objectives.items():
        if not node.get("alone", False):
            continue
        for other, o in objectives.items():
            if other != name and (o.get("weight", 1.0) != 0 or o.get("final_weight", 0.0) != 0):
                key = "weight" if o.get("weight", 1.0) != 0 else "final_weight"
                yield f"algo.objectives.{other}.{key}", (
                    f" = {o.get(key)}: algo.objectives.{name} trains alone (alone=true: ECHO without a verifier, "
                    f"algo=echo_only, where action tokens get no gradient and the reward is not used); set it to 0")


def node_value_tree(s: Resolved) -> Problem:
    if s.data.get("advantage_mode") != "node_value":
        return
    collector = resolve((s.data.get("collector") or {}).get("_target_"))
    if not getattr(collector, "needs_fork", False):
        yield "data.advantage_mode", (" = node_value: node-value advantages (TreeRL) read the tree of a branched group; "
                                      "use them with a collector that branches (+collector=branching), or grpo/drgrpo")


RULES: tuple[Rule, ...] = (
    Rule(("model.attn_implementation", "data.share_prefix", "callbacks.*.packing", "callbacks.*.update"),
         "sdpa attention for shared prefixes and CoPE's packed forecast rows (4D masks)", attention_fits_packing),
    Rule(("trainer.strategy",), "a strategy that shards the weights gathers them for rollouts (gathers_for_rollouts)",
         sharding_gathers),
    Rule(("trainer.strategy", "model.quantization"), "sharded weights (shards_weights) are not quantized",
         sharding_quantized),
    Rule(("trainer.strategy", "data.engine"), "sharded weights (shards_weights): an engine that samples in process "
         "(samples_in_process)", sharding_engine),
    Rule(("trainer.strategy", "callbacks.*.merged"), "sharded weights (shards_weights): no merged export",
         sharding_merged),
    Rule(("trainer.strategy", "callbacks.*.every_n_steps"), "sharded weights (shards_weights): no gradient probes",
         sharding_grad_stats),
    Rule(("data.max_lag", "data.engine", "data.sampling.top_p"), "lagged rollouts: an engine that overlaps "
         "(overlaps), top_p=1", lag_engine),
    Rule(("data.max_lag", "data.engine", "model.finetune", "trainer.strategy"), "lagged rollouts from an engine that "
         "samples in process (samples_in_process): an adapter to copy, whole weights", lag_sampler_copy),
    Rule(("data.max_lag", "data.engine", "data.engine.max_loras", "data.engine.url"), "lagged rollouts from an engine "
         "that serves adapters (serves_adapters): two LoRA slots", lag_adapter_slots),
    Rule(("model.finetune", "model.quantization", "model.adapter", "model.dtype"), "full fine-tuning: fp32 weights, not "
         "quantized, no adapter to start from", finetune_values),
    Rule(("model.finetune", "data.engine"), "full fine-tuning: an engine that samples in process (samples_in_process)",
         finetune_engine),
    Rule(("model.finetune", "callbacks.*.merged"), "full fine-tuning: no adapter to merge", finetune_merged),
    Rule(("model.finetune", "trainer.precision"), "full fine-tuning: fp32 master weights (no *-true half precision)",
         finetune_precision),
    Rule(("data.collector", "data.engine"), "a collector that samples completions (needs_completions): an engine that "
         "completes (completes)", collector_engine),
    Rule(("data.collector", "env"), "a collector that replays the env's expert (needs_expert): an env with "
         "expert_action()", collector_expert),
    Rule(("env.action_format", "model._target_", "model.path"), "native tool calls: a model whose chat template "
         "renders tools", native_tools_template),
    Rule(("data.collector", "env", "data.engine", "data.env_runtime.workers"), "a collector that branches episodes "
         "(needs_fork): an env with fork() or forks_by_replay, an engine that lends its sampling actor, "
         "forks_by_replay with env workers",
         collector_forks),
    Rule(("algo.objectives.*.alone", "algo.objectives.*.weight", "algo.objectives.*.final_weight"),
         "an objective that trains alone (ECHO without a verifier): every other objective at weight 0", objective_alone),
    Rule(("data.advantage_mode", "data.collector"), "node-value advantages: a collector that branches (needs_fork)",
         node_value_tree),
)


def check_rules(cfg: DictConfig, fail: Callable[[str, str], None]) -> None:
    """Every row of :data:`RULES` against ``cfg`` (``fail(key, message)`` per problem)."""
    resolved = Resolved(cfg)
    for rule in RULES:
        for key, message in rule.check(resolved):
            fail(key, message)


def cross_field(cfg: DictConfig, fail: Callable[[str, str], None], warnings: list[str]) -> None:
    """The rules between keys (``fail(key, message)``) and the settings that make training a no-op (``warnings``)."""
    data, model = cfg.get("data"), cfg.get("model")
    if isinstance(data, DictConfig) and isinstance(model, DictConfig):
        context_fits_model(data, model, fail)
    if isinstance(data, DictConfig) and data.get("group_size") == 1:
        warnings.append("data.group_size=1: one episode per group, so every group-relative advantage is 0 "
                        "and the policy gradient is 0 (only auxiliary objectives train)")
    accelerator = (cfg.get("trainer") or {}).get("accelerator")
    if accelerator in ("gpu", "cuda") and not _cuda_available():
        fail("trainer.accelerator", f" = {accelerator!r}: this machine has no CUDA GPU (torch.cuda.is_available() is "
             "False); use trainer=cpu in place of trainer=gpu, or trainer.accelerator=cpu")
    if isinstance(cfg.get("trainer"), DictConfig):
        check_launch(cfg.trainer, fail)
    check_rules(cfg, fail)
    optimizer = (cfg.get("module") or {}).get("optimizer") or {}
    if optimizer.get("lr") == 0:
        warnings.append("module.optimizer.lr=0: the adapter never changes (rollouts and validation run, "
                        "nothing is learned)")
    objectives = [o for o in ((cfg.get("algo") or {}).get("objectives") or {}).values() if o is not None]
    if objectives and all(o.get("weight", 1.0) == 0 and o.get("final_weight", 0.0) == 0 for o in objectives):
        warnings.append("every algo.objectives.*.weight is 0: training changes nothing")


def _cuda_available() -> bool:
    import torch  # only for a GPU trainer: the check stays torch-free otherwise

    return torch.cuda.is_available()


def _packed_key(cls: type, node: DictConfig) -> str | None:
    """The key that puts CoPE's forecasts in packed segments (``packing=packed`` of the continuation targets,
    ``packing=packed`` of the authors' samples with ``update=joint``), or None."""
    from cope.algos.cope.forecast_targets import ForecastTargets
    from cope.algos.cope.forecasts import CopeForecasts

    if issubclass(cls, ForecastTargets) and node.get("packing") == "packed":
        return "packing=packed"
    if issubclass(cls, CopeForecasts) and node.get("update") == "joint" and node.get("packing") == "packed":
        return "packing=packed (update=joint)"
    return None
