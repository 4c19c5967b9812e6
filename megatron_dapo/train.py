"""Entry point: python -m megatron_dapo.train --config FILE [dotted.overrides=...]  (torchrun for several ranks)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from megatron_dapo.config import load_config, to_yaml


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=None, help="YAML config file (defaults: the paper's values)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.eps_high=0.28")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(args.config, args.overrides)

    import torch.distributed as dist

    from megatron_dapo.trainer import Trainer, progress_line

    trainer = Trainer(cfg)
    rank0 = dist.get_rank() == 0
    run_dir = Path(cfg.trainer.run_dir)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
    try:
        while trainer.step < cfg.trainer.total_steps:
            metrics = trainer.train_step()
            if rank0:
                print(progress_line(metrics), flush=True)
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(metrics) + "\n")
            every = cfg.trainer.save_every
            if (every and trainer.step % every == 0) or trainer.step == cfg.trainer.total_steps:
                trainer.save()
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
