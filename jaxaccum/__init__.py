"""jaxaccum: exact, fast gradient accumulation for JAX and Optax."""

from jaxaccum._accumulate import value_and_grad
from jaxaccum._keys import per_example_keys
from jaxaccum._multi_steps import MultiStepsState, has_updated, multi_steps
from jaxaccum._plan import MemoryEstimate, MicrobatchPlan, plan_microbatches
from jaxaccum._train_step import train_step

__all__ = [
    "MemoryEstimate",
    "MicrobatchPlan",
    "MultiStepsState",
    "has_updated",
    "multi_steps",
    "per_example_keys",
    "plan_microbatches",
    "train_step",
    "value_and_grad",
]

__version__ = "0.1.0"
