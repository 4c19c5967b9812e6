"""One typed config tree for megatron-dapo.

Every field is a dataclass field with the DAPO paper's value (Yu et al. 2025,
arXiv 2503.14476) as its default. A run's config is the defaults, then a YAML file,
then dotted command-line overrides (``algorithm.eps_high=0.28``), merged by
OmegaConf structured configs, which check types. On top of that:

- an unknown key is an error that names the source and the nearest valid key;
- impossible values (negative eps, an overlong buffer longer than the maximum
  response, a group of one) are errors that name the field and what was expected.

    cfg = load_config("examples/tiny_cpu.yaml", ["algorithm.eps_high=0.3"])

The package, one module per section (or a few related ones), each dataclass with its field docstrings and its own
`validate()`; the allowed values of the string fields live in megatron_dapo.choices:

- base.py: ConfigError, the check that raises it, field_docs;
- algorithm.py (algorithm), rollout.py (rollout, pipeline), data.py (data, reward), sampler.py (sampler),
  policy.py (optim, model, parallel, train), trainer.py (trainer, eval);
- rules.py: the root Config, the settings derived from several sections (tis_cap, lockstep, ...) and the checks
  that span sections;
- loading.py: load_config (YAML file, merging, dotted overrides, unknown keys) and to_yaml.

Nothing here imports torch: reading a config stays instant.
"""

from megatron_dapo.choices import DTYPES
from megatron_dapo.config.algorithm import AlgorithmConfig, Correction
from megatron_dapo.config.base import ConfigError, field_docs
from megatron_dapo.config.data import DataConfig, RewardConfig
from megatron_dapo.config.loading import load_config, to_yaml
from megatron_dapo.config.policy import ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megatron_dapo.config.rollout import PipelineConfig, RolloutConfig
from megatron_dapo.config.rules import Config
from megatron_dapo.config.sampler import SamplerConfig
from megatron_dapo.config.trainer import EvalConfig, TrainerConfig

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
