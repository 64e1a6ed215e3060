"""The sample-efficiency studies: GRPO against its auxiliary objectives, equally tuned, on paired seeds.

- :mod:`bench.study.launch`: the regimes (``SPEC``), their tuning and test runs; ``python -m bench.study``.
- :mod:`bench.study.runs`: one ``train.py`` run as a resumable subprocess, and the launchers' SIGTERM handling.
- :mod:`bench.study.records`: checkpoint-free copies of finished runs, committed, restored on a fresh checkout.
- :mod:`bench.study.report`: per-run curves and per-arm statistics from the run folders; the plots.
- :mod:`bench.study.final_eval`: each test run's last checkpoint evaluated on a larger panel (eval.py), and its table.
- :mod:`bench.study.markdown`: ``study.md``, the report's tables.
- :mod:`bench.study.stats`: the statistics (bootstrap and paired t intervals, AUC), pure functions.
- :mod:`bench.study.probes`: held-out forecast probes of a study's finished runs, after the fact
  (``python -m bench.study.probes``).
"""
