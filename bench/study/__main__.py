"""``python -m bench.study ...``: the study launcher (:func:`bench.study.launch.main`)."""
import sys

from bench.study.launch import main

sys.exit(main())
