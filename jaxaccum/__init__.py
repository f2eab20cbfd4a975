"""jaxaccum: exact, fast gradient accumulation for JAX and Optax.

The Flax front ends are submodules, imported on their own: ``jaxaccum.nnx`` (needs flax) and
``jaxaccum.linen`` (duck-typed, for ``flax.training.train_state.TrainState``).
"""

from jaxaccum._check import CheckReport, check
from jaxaccum._coupled import (
    coupled_train_step,
    coupled_value_and_grad,
    statistics_first,
    statistics_first_train_step,
)
from jaxaccum._cross_entropy import linear_cross_entropy
from jaxaccum._keys import per_example_keys
from jaxaccum._microbatches import Microbatches, microbatches
from jaxaccum._multi_steps import (
    MultiStepsState,
    MultiStepsTransformation,
    has_updated,
    multi_steps,
)
from jaxaccum._noise import NoiseScale
from jaxaccum._options import DataParallel, Options, OptionsDict
from jaxaccum._plan import MemoryEstimate, MicrobatchPlan, plan_microbatches
from jaxaccum._train_step import StepInfo, TrainStep, train_step
from jaxaccum._value_and_grad import value_and_grad

__all__ = [
    "CheckReport",
    "DataParallel",
    "MemoryEstimate",
    "MicrobatchPlan",
    "Microbatches",
    "MultiStepsState",
    "MultiStepsTransformation",
    "NoiseScale",
    "Options",
    "OptionsDict",
    "StepInfo",
    "TrainStep",
    "check",
    "coupled_train_step",
    "coupled_value_and_grad",
    "has_updated",
    "linear_cross_entropy",
    "microbatches",
    "multi_steps",
    "per_example_keys",
    "plan_microbatches",
    "statistics_first",
    "statistics_first_train_step",
    "train_step",
    "value_and_grad",
]

__version__ = "0.1.0"
