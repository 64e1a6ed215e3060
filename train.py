"""Train a language agent: `python train.py [group=option ...] [key=value ...]` (see README)."""
import hydra
from omegaconf import DictConfig

from cope.run.train import train


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
