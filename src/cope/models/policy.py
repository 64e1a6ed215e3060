"""The policy: a causal LM (LoRA-adapted, or trained whole), its tokenizer and chat scaffold.

Loading stays apart from training (litgpt's ``lora.py`` vs ``finetune/lora.py``): this module builds
the model (``from_pretrained`` on a local folder, or on a hub id's snapshot folder in the HF cache,
:mod:`cope.hub`; no network at run time when ``local_files_only``), optionally 4-bit (QLoRA via
bitsandbytes), wraps it in peft LoRA (``finetune="lora"``) or makes every parameter trainable (``finetune="full"``)
and returns a :class:`Policy`. The KL reference (:meth:`Policy.reference`) is, under LoRA, the same model with the
adapter disabled (no second copy in memory); under full fine-tuning a frozen copy of the starting weights
(:meth:`Policy.freeze_reference`: one more model in memory, sharded like the policy under ``trainer=fsdp``).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, get_args

import torch

from cope.chat import ChatFormat
from cope.extras import require
from cope.hub import resolve_model_path
from cope.models.choices import Dtype, Finetune, Quantization

log = logging.getLogger(__name__)

DTYPES = dict(zip(get_args(Dtype), (torch.float32, torch.bfloat16, torch.float16)))  # fp32, bf16, fp16
QUANTIZATIONS = (None, *get_args(Quantization))
FINETUNES = get_args(Finetune)  # model.finetune


@dataclass
class Policy:
    model: Any  # peft.PeftModel wrapping a transformers causal LM (finetune "lora"), or the causal LM itself ("full")
    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    chat: ChatFormat
    source: str  # model.path as given (a local folder or a hub id): what checkpoints and exports record
    finetune: str = "lora"  # model.finetune: "lora" (an adapter is trained) or "full" (every parameter)
    # a context in which the model's weights are whole on every rank (rollouts); trainer=fsdp sets it
    # (cope.train.fsdp.sharding.WholeWeights), a null context otherwise
    full_weights: Callable[[], ContextManager] = field(default=contextlib.nullcontext, repr=False)
    # full fine-tuning: the frozen copy of the starting weights (freeze_reference), and the context in which its
    # weights are whole (trainer=fsdp: cope.train.fsdp.sharding.SwappedWeights; a null context otherwise)
    reference_model: Any = field(default=None, repr=False)
    reference_weights: Callable[[], ContextManager] = field(default=contextlib.nullcontext, repr=False)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def freeze_reference(self) -> None:
        """Full fine-tuning: keep a frozen copy of the weights as they are now (the start of training) as the KL
        reference; call it before any update and before a checkpoint is loaded. A no-op under LoRA (the reference is
        the adapter-disabled model) or when the copy exists."""
        if self.finetune != "full" or self.reference_model is not None:
            return
        import copy

        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        self.reference_model = ref.eval()

    @contextlib.contextmanager
    def reference(self) -> Iterator[Any]:
        """``with policy.reference() as ref:`` the model whose log-probs are the KL reference: the policy's own model
        with the adapter disabled (LoRA), or the frozen copy of :meth:`freeze_reference` (full fine-tuning), on the
        policy's device and, under ``trainer=fsdp``, gathered while the policy is sharded."""
        if self.finetune != "full":
            with self.model.disable_adapter():
                yield self.model
            return
        if self.reference_model is None:
            raise RuntimeError("full fine-tuning: Policy.freeze_reference() was not called before the first update, so "
                               "there is no KL reference (the trainer calls it in configure_model when a KL term is on)")
        device = next(self.model.parameters()).device
        if next(self.reference_model.parameters()).device != device:
            self.reference_model.to(device)
        with self.reference_weights():
            yield self.reference_model


def _quant_config(quantization: str | None, compute_dtype: torch.dtype):
    if quantization is None:
        return None
    require("bitsandbytes", extra="quant", feature=f"model.quantization={quantization}")
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _disable_cpu_bf16_repack(model) -> int:
    """bitsandbytes 0.50 on CPUs with avx512_bf16 repacks 4-bit weights at the first eval forward,
    after which every training step fails ("a view of a leaf Variable that requires grad is being used in
    an in-place operation"; measured on this project's CPU machines). Rollout-then-train is exactly
    that pattern, so switch the repack off on every 4-bit linear layer. Returns how many were patched."""
    import bitsandbytes as bnb

    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def load_pretrained(
    path: str,
    lora: Any,
    dtype: Dtype = "bf16",
    quantization: Quantization | None = None,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    local_files_only: bool = True,
    trust_remote_code: bool = False,
    adapter: str | None = None,
    source_is_cache_key: bool = False,
    finetune: Finetune = "lora",
    env_factory: Any = None,  # unused: accepted so every model config has the same call signature
    chat_template: str | None = None,
) -> Policy:
    """Load a causal LM + tokenizer from a local folder or the HF cache and add a LoRA adapter (or train it whole).

    Args:
        path: local folder or hub id (its snapshot folder in the local HF cache when ``local_files_only``);
            recorded as given in :attr:`Policy.source`.
        lora: a ``peft.LoraConfig`` (Hydra instantiates it from ``model.lora``).
        dtype: ``fp32``, ``bf16`` or ``fp16`` for the base weights (and 4-bit compute).
        quantization: ``None``, ``4bit`` (nf4 QLoRA) or ``8bit``; needs the ``quant`` extra.
        chat_template: replaces the tokenizer's chat template: a name of :data:`cope.chat.templates.TEMPLATES`
            (``chatml-hermes``: ChatML with Qwen2.5's tool format) or a template file (None: the model's own).
        gradient_checkpointing: recompute activations in backward (non-reentrant, LoRA-safe).
        attn_implementation: ``sdpa`` (default; needed for packed CoPE forecasts on CPU), ``eager``, or
            ``flash_attention_2`` (not with CoPE's packed layout: the config check refuses it).
        local_files_only: never reach the network at run time.
        adapter: a peft LoRA folder to start from (an export's ``csv/adapter``, an SFT adapter, a colleague's): its
            weights and config, trainable; None: a fresh adapter from ``lora``. Its base model (``cope_export.json``,
            else ``adapter_config.json``) must be this one and its rank ``lora.r`` (checked in :func:`attach_lora`).
        source_is_cache_key: the folder's name identifies the model (the tiny and GGUF caches): an adapter recorded
            under the same name in another cache root counts as made on this base.
        finetune: ``lora`` (the adapter is trained, the base frozen) or ``full`` (every parameter is trained; ``lora``
            and ``adapter`` are not used, quantized weights cannot be trained): :func:`check_finetune`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"model.quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    check_finetune(finetune, quantization, adapter, dtype)
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cope.chat.templates import chat_template as template_text

    template = None if chat_template is None else template_text(chat_template)  # a bad choice fails before loading
    files = resolve_model_path(path, local_files_only)  # a hub id: its snapshot folder in the HF cache
    torch_dtype = DTYPES[dtype]
    try:
        tokenizer = AutoTokenizer.from_pretrained(files, local_files_only=local_files_only, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            files,
            dtype=torch_dtype,
            quantization_config=_quant_config(quantization, torch_dtype),
            attn_implementation=attn_implementation,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
        )
    except OSError as e:  # a folder without the model's files (an interrupted download, a wrong folder)
        raise FileNotFoundError(
            f"could not load model.path={path!r} from {files} ({e.__class__.__name__}: {e}): the folder lacks the "
            "model's files. Download it completely (`huggingface-cli download <hub id>`, into the HF cache) or set "
            "model.path to a local folder that holds the whole model."
        ) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if template is not None:
        tokenizer.chat_template = template
    if quantization == "4bit":
        log.info("patched %d 4-bit layers against the CPU bf16 repack", _disable_cpu_bf16_repack(model))
    if quantization is not None:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
    for p in model.parameters():
        p.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    # the scaffold from the model's own chat template; every eos id of its generation config ends a turn
    chat = ChatFormat.from_template(tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if finetune == "full":
        model.requires_grad_(True)
    else:
        model = attach_lora(model, lora, adapter, str(path), source_is_cache_key)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in model.parameters())
    how = "full fine-tuning" if finetune == "full" else f"LoRA r={getattr(lora, 'r', '?')}"
    log.info("policy %s: %d trainable / %d parameters (%s)", path, n_train, n_all, how)
    # built to train: from_pretrained leaves the base in eval mode, and only a rollout on the model itself (which
    # restores the mode it found on the whole model) would switch it back before the first step (Lightning warns)
    model.train()
    return Policy(model=model, tokenizer=tokenizer, chat=chat, source=str(path), finetune=finetune)


def finetune_problem(finetune: str, quantization: str | None = None, adapter: str | None = None,
                     dtype: str = "fp32") -> tuple[str, str] | None:
    """What ``model.finetune`` cannot take, as (the key to change, the message), or None."""
    if finetune not in FINETUNES:
        return "model.finetune", f"model.finetune must be one of {FINETUNES}, got {finetune!r}"
    if finetune != "full":
        return None
    if dtype != "fp32":  # AdamW would update the bf16/fp16 weights in place: small updates round away, every step
        return "model.dtype", (
            f"model.finetune=full with model.dtype={dtype}: AdamW would update {dtype} weights in place, and an update "
            "under half a rounding step (about 0.4% of a weight in bf16) is lost: at lr 1e-6 most weights never move. "
            "Set model.dtype=fp32 (fp32 master weights): under trainer=fsdp the forward still runs in bf16 on GPUs "
            "(trainer.strategy.mixed_precision=auto); under DDP set trainer.precision=bf16-mixed")
    if quantization is not None:
        return "model.quantization", (
            f"model.finetune=full with model.quantization={quantization}: quantized weights cannot be trained; set "
            "model.quantization=null (full fine-tuning trains fp32 master weights) or model.finetune=lora (QLoRA)")
    if adapter is not None:
        return "model.adapter", (
            f"model.finetune=full with model.adapter={adapter!r}: a LoRA adapter is not a starting point for full "
            "fine-tuning; merge it into the base first (peft's merge_and_unload, saved as a model folder for "
            "model.path), or keep model.finetune=lora")
    return None


def check_finetune(finetune: str, quantization: str | None = None, adapter: str | None = None,
                   dtype: str = "fp32") -> None:
    """Raises ValueError with :func:`finetune_problem`'s message (the config check reports it under its key)."""
    problem = finetune_problem(finetune, quantization, adapter, dtype)
    if problem is not None:
        raise ValueError(problem[1])


def adapter_base(folder: Path) -> str | None:
    """The base model an adapter folder was made on: ``cope_export.json``'s ``base_model`` (our exports), else
    peft's ``adapter_config.json`` ``base_model_name_or_path``; None when neither says."""
    import json

    for name, key in (("cope_export.json", "base_model"), ("adapter_config.json", "base_model_name_or_path")):
        f = folder / name
        if f.is_file():
            value = json.loads(f.read_text()).get(key)
            if value:
                return str(value)
    return None


def check_adapter(adapter: str, source: str, lora: Any, source_is_cache_key: bool = False) -> Path:
    """The adapter folder, or one clear error: no peft adapter there, made on another base model than ``source``, or
    of another LoRA rank than ``lora.r``. Runs before any model is loaded (the config check calls it too)."""
    import json

    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"model.adapter={adapter!r}: no adapter_config.json there (a peft LoRA folder, e.g. an "
                                "earlier run's <run>/csv/adapter)")
    base = adapter_base(folder)
    same = base is None or base == source or (source_is_cache_key and Path(base).name == Path(source).name) or \
        (Path(base).expanduser().exists() and Path(base).expanduser().resolve() == Path(source).expanduser().resolve())
    if not same:
        raise ValueError(f"model.adapter={adapter!r} was made on base model {base!r}, but this run's base is {source!r} "
                         "(model.path or the model settings): start from an adapter of this base, or change the model")
    r = json.loads((folder / "adapter_config.json").read_text()).get("r")
    want = getattr(lora, "r", None)
    if r is not None and want is not None and int(r) != int(want):
        raise ValueError(f"model.adapter={adapter!r} has LoRA rank r={r}, model.lora.r={want}: set model.lora.r={r} "
                         "(the adapter's shape is what is loaded)")
    return folder


def attach_lora(model, lora: Any, adapter: str | None = None, source: str = "", source_is_cache_key: bool = False):
    """``model`` with a trainable LoRA adapter: a fresh one from ``lora``, or the one in ``adapter`` (checked by
    :func:`check_adapter`). The KL reference stays the adapter-disabled base either way."""
    from peft import PeftModel, get_peft_model

    if adapter is None:
        return get_peft_model(model, lora)
    folder = check_adapter(adapter, source, lora, source_is_cache_key)
    log.info("starting from the adapter in %s", folder)
    return PeftModel.from_pretrained(model, str(folder), is_trainable=True)
