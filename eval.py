"""Evaluate a policy: `python eval.py [env=...] [model=...] [adapter=<dir> | ckpt_path=<file>] [eval.*=...]` (see README)."""
import sys

import hydra
from omegaconf import DictConfig

from cope.run.config_keys import refuse_renamed
from cope.run.evaluate import evaluate


@hydra.main(version_base="1.3", config_path="conf", config_name="eval")
def main(cfg: DictConfig) -> None:
    evaluate(cfg)


if __name__ == "__main__":
    refuse_renamed(sys.argv[1:])  # an old key names its replacement (Hydra alone would say "not in struct")
    main()
