"""One typed config tree for megatron-dapo.

Every field is a dataclass field with the DAPO paper's value (Yu et al. 2025,
arXiv 2503.14476) as its default. A run's config is the defaults, then a YAML file,
then dotted command-line overrides (``algorithm.eps_high=0.28``), merged by
OmegaConf structured configs, which check types. On top of that:

- an unknown key is an error that names the source and the nearest valid key;
- impossible values (negative eps, an overlong buffer longer than the maximum
  response, a group of one) are errors that name the field and what was expected.

    cfg = load_config("examples/tiny_cpu.yaml", ["algorithm.eps_high=0.3"])

The package, one module per section, each dataclass with its field docstrings and its own
`validate()`; the allowed values of the string fields live in megatron_dapo.choices:

- base.py: ConfigError, the check that raises it, field_docs;
- one module per section, named after it: algorithm.py, rollout.py, pipeline.py, data.py, reward.py, sampler.py,
  optim.py, model.py, parallel.py, train.py, trainer.py, eval.py;
- rules.py: the root Config, the settings derived from several sections (tis_cap, lockstep, ...) and the checks
  that span sections;
- loading.py: load_config (YAML file, merging, dotted overrides, unknown keys) and to_yaml.

Nothing here imports torch: reading a config stays instant.
"""

from megatron_dapo.choices import DTYPES
from megatron_dapo.config.algorithm import AlgorithmConfig, Correction
from megatron_dapo.config.base import ConfigError, field_docs
from megatron_dapo.config.data import DataConfig
from megatron_dapo.config.eval import EvalConfig
from megatron_dapo.config.loading import load_config, to_yaml
from megatron_dapo.config.model import ModelConfig
from megatron_dapo.config.optim import OptimConfig
from megatron_dapo.config.parallel import ParallelConfig
from megatron_dapo.config.pipeline import PipelineConfig
from megatron_dapo.config.reward import RewardConfig
from megatron_dapo.config.rollout import RolloutConfig
from megatron_dapo.config.rules import Config
from megatron_dapo.config.sampler import SamplerConfig
from megatron_dapo.config.train import TrainConfig
from megatron_dapo.config.trainer import TrainerConfig

__all__ = [
    "DTYPES",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "Correction",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "PipelineConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplerConfig",
    "TrainConfig",
    "TrainerConfig",
    "field_docs",
    "load_config",
    "to_yaml",
]
