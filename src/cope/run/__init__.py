"""Run plumbing: from a composed config to a finished (or resumable) fit.

* :mod:`~cope.run.train`: ``train(cfg)``, what ``train.py`` calls.
* :mod:`~cope.run.evaluate`: ``evaluate(cfg)``, what ``eval.py`` calls.
* :mod:`~cope.run.config_check`: the config checked against the constructors before any work.
* :mod:`~cope.run.config_keys`: every key read by something, or refused; renamed keys name their replacement.
* :mod:`~cope.run.config_rules`: the compatibility rules, one table read from capabilities; GPU, launch, no-op warnings.
* :mod:`~cope.run.config_classes`: the classes a config names, resolved for those rules (nothing built).
* :mod:`~cope.run.context_limits`: ``data.max_context`` against the model's positions and the first prompt.
* :mod:`~cope.run.signatures`: signature and annotation matching for that check.
* :mod:`~cope.run.checkpoint_io`: atomic checkpoint writes, free-space checks.
* :mod:`~cope.run.loggers`: the resumable CSV logger.
* :mod:`~cope.run.preemption`: SIGTERM handling.
"""
