"""jaxaccum: exact, fast gradient accumulation for JAX and Optax.

The Flax front ends are submodules, imported on their own: ``jaxaccum.nnx`` (needs flax) and
``jaxaccum.linen`` (duck-typed, for ``flax.training.train_state.TrainState``).
"""

from jaxaccum._accumulate import value_and_grad
from jaxaccum._keys import per_example_keys
from jaxaccum._multi_steps import (
    MultiStepsState,
    MultiStepsTransformation,
    has_updated,
    multi_steps,
)
from jaxaccum._plan import MemoryEstimate, MicrobatchPlan, plan_microbatches
from jaxaccum._train_step import TrainStep, train_step

__all__ = [
    "MemoryEstimate",
    "MicrobatchPlan",
    "MultiStepsState",
    "MultiStepsTransformation",
    "TrainStep",
    "has_updated",
    "multi_steps",
    "per_example_keys",
    "plan_microbatches",
    "train_step",
    "value_and_grad",
]

__version__ = "0.1.0"
