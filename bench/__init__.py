"""Benchmarks and studies: scripts that print measured ratios, and the study package (:mod:`bench.study`).

Run them from the repository root as modules, ``python -m bench.<script> ...`` (``python -m bench.study ...`` for the
study launcher), so that they import each other as ``bench.*``. bench/README.md lists every script with the
claim it backs.
"""
