"""Building the policy: the LoRA-wrapped causal LM, its tokenizer and chat scaffold.

* :mod:`~cope.models.policy`: ``Policy`` and ``load_pretrained`` (local folders, hub ids from the HF cache).
* :mod:`~cope.hub`: what a ``model.path`` names (a folder, or a hub id's snapshot in the local HF cache).
* :mod:`~cope.models.source`: which base model a model config builds, without building it (resume checks).
* :mod:`~cope.models.tiny`: the CPU demo model, trained from nothing on an env (tokenizer + warm start).
* :mod:`~cope.models.warm_start`: the walkers the tiny model is behaviour-cloned from.
* :mod:`~cope.models.gguf`: GGUF weights (SmolLM2) converted once into a normal folder.
* :mod:`~cope.models.build_cache`: build-once, atomically published cache folders.
"""
