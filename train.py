"""Train a language agent: `python train.py [group=option ...] [key=value ...]` (see README)."""
import sys

import hydra
from omegaconf import DictConfig

from cope.run.config_keys import refuse_renamed
from cope.run.launch import rank_overrides
from cope.run.train import train


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    refuse_renamed(sys.argv[1:])  # an old key names its replacement (Hydra alone would say "not in struct")
    sys.argv += rank_overrides()  # not global rank 0 (torchrun, srun): no .hydra/ and a log of its own in the shared run dir
    main()
