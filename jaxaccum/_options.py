"""The accumulation options, defined and validated once for every front end.

Every front end (:func:`jaxaccum.value_and_grad`, :func:`jaxaccum.train_step`,
``jaxaccum.nnx.value_and_grad`` / ``train_step``, ``jaxaccum.linen.train_step``) takes these
options as keywords and builds one :class:`Options` with :func:`parse`, which names the entry
point the user called in every error. What a front end adds of its own (``argnums``,
``batch_argnums``, ``carry_argnums``, ``donate``, ``wrt``) is not an option here.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Literal, TypedDict, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from jaxaccum import _reductions, _validation
from jaxaccum._reductions import AuxReductionName

FsdpMode = Literal["step", "microbatch"]
FSDP_MODES: tuple[FsdpMode, ...] = get_args(FsdpMode)
# has_aux: a bool, a reduction's name, or a pytree prefix of the aux whose leaves are names
# (a dict, tuple, list or NamedTuple: a Sequence would let any str through the Literal)
HasAux = bool | AuxReductionName | Mapping[Any, Any] | tuple[Any, ...] | list[Any]

# Options that existed once: what to write instead.
RENAMED = {
    "aux_reduce": "write has_aux=<reduction>: has_aux takes True (stack), a reduction name "
    "such as 'concat' or 'sum', or a tree of names",
    "data_axis": "write mesh=jaxaccum.DataParallel(mesh, data_axis=...)",
    "fsdp": "write mesh=jaxaccum.DataParallel(mesh, data_axis=..., fsdp=...)",
    "param_shardings": "write mesh=jaxaccum.DataParallel(mesh, ..., param_shardings=...)",
    "remat": "wrap your loss in jax.checkpoint yourself (remat inside the micro-step saved "
    "no memory in the benchmarks: the micro-batch already bounds activations)",
}


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A mesh and how jaxaccum uses it: the one ``mesh=`` option for sharded training.

    jaxaccum handles only the mesh's *data* axes (the batch's leading axis is split over them
    and the gradients are reduced over them once per step); every other axis (tensor parallel
    ``"model"``, ...) stays with JAX's partitioner, and parameters keep the shardings they
    arrive with.

    Attributes:
      mesh: the ``jax.sharding.Mesh``. Explicit axes (``jax.make_mesh``'s default) need the
        mesh in context (``with jax.set_mesh(mesh):``) where you call ``value_and_grad``.
      data_axis: the mesh axis, or tuple of axes, the batch is split over; may be omitted for
        a one-axis mesh.
      fsdp: for parameters sharded over a data axis (FSDP/ZeRO): ``"step"`` gathers each once
        per step (a transient full parameter and gradient per device); ``"microbatch"``
        gathers it in every micro-batch and reduce-scatters every micro-batch's gradient into
        a sharded accumulator (ZeRO-3: less memory, k times the traffic).
      param_shardings: only for Auto-axis meshes when you call ``value_and_grad`` under your
        own ``jax.jit``, where tracers carry no sharding: the shardings (``PartitionSpec`` or
        ``NamedSharding`` leaves) of the differentiated arguments, a tree like them. Without
        it an FSDP parameter is taken as replicated (exact, but gathered).

    Raises:
      TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
      ValueError: the mesh has no axes; ``data_axis`` is missing on a mesh with several
        axes, names no axis of the mesh or is empty; ``fsdp`` is not ``"step"`` or
        ``"microbatch"``; ``param_shardings`` given for Explicit data axes.

    Examples:
      >>> import jax, jaxaccum
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> jaxaccum.DataParallel(mesh).axes
      ('data',)
    """

    mesh: jax.sharding.Mesh
    data_axis: str | tuple[str, ...] | None = None
    fsdp: FsdpMode = "step"
    param_shardings: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(
                f"jaxaccum.DataParallel: mesh must be a jax.sharding.Mesh; got "
                f"{type(self.mesh).__name__}"
            )
        if self.fsdp not in FSDP_MODES:
            raise ValueError(
                f"jaxaccum.DataParallel: fsdp must be one of {FSDP_MODES}; got {self.fsdp!r}"
            )
        names = self.mesh.axis_names
        if not names:
            raise ValueError(
                "jaxaccum.DataParallel: mesh has no axes; the batch is split over a mesh axis: "
                "e.g. jax.make_mesh((jax.device_count(),), ('data',))"
            )
        if self.data_axis is None and len(names) != 1:
            raise ValueError(
                f"jaxaccum.DataParallel: data_axis must name the batch axis (or axes) of a mesh "
                f"with several axes; the mesh axes are {names}: e.g. "
                f"DataParallel(mesh, data_axis={names[0]!r})"
            )
        missing = [a for a in self.axes if a not in names]
        if missing or not self.axes:
            raise ValueError(
                f"jaxaccum.DataParallel: data_axis={self.data_axis!r} is not an axis of the "
                f"mesh; the mesh axes are {names}"
            )
        if self.param_shardings is not None and self.explicit:
            # Explicit axes carry each parameter's sharding in its type: hints would be ignored
            raise ValueError(
                "jaxaccum.DataParallel: param_shardings is for Auto-axis meshes (where tracers "
                f"carry no sharding); the data axes {self.axes} of this mesh are Explicit, "
                "where every parameter's sharding is in its type and is used as it is: drop "
                "param_shardings"
            )

    @property
    def axes(self) -> tuple[str, ...]:
        """The data axes as a tuple, in the order the batch is split over them."""
        if self.data_axis is None:
            return tuple(self.mesh.axis_names)
        return (self.data_axis,) if isinstance(self.data_axis, str) else tuple(self.data_axis)

    @property
    def explicit(self) -> bool:
        """Whether the data axes are Explicit (sharding in types) rather than Auto."""
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        return all(types[a] == jax.sharding.AxisType.Explicit for a in self.axes)


# (the entry point building Options, named in its errors; whether it takes a runtime count:
# the coupled losses do not, so their messages do not suggest one). Set by parse only.
_CALLER: contextvars.ContextVar[tuple[str, bool]] = contextvars.ContextVar(
    "jaxaccum_options_caller", default=("jaxaccum.Options", True))


@dataclasses.dataclass(frozen=True)
class Options:
    """The accumulation options every front end shares (pass them as keywords).

    Attributes:
      num_microbatches: k, the number of micro-batches (per device on a mesh); it must divide
        the batch size. Exactly one of this, ``microbatch_size`` and ``max_microbatches``.
      microbatch_size: the size of each micro-batch instead of k.
      max_microbatches: K, for a number of micro-batches known only at run time: the batch
        is passed as a :class:`jaxaccum.Microbatches` ``(data, count)``, ``data`` leaves
        shaped ``(K, m, ...)``, and one compiled program runs the first ``count`` (a traced
        loop bound: the others cost nothing), for every count from 0 to K.
      has_aux: whether ``fun`` returns ``(loss, aux)``, and how the aux values of the k
        micro-batches are combined: ``False``; ``True`` or ``"stack"`` (a new leading axis of
        length k, one entry per micro-batch); ``"concat"`` (per-example values concatenated
        back into the batch's own order, as the full batch would return them: logits,
        per-example losses); ``"sum"``, ``"mean"``, ``"weighted_mean"`` (by the micro-batch
        weights), ``"max"``, ``"min"``, ``"last"``; or a pytree prefix of the aux with those
        names as leaves, e.g. ``{"logits": "concat", "tokens": "sum"}``. The reductions run
        over the micro-batches kept (a micro-batch skipped by ``skip_nonfinite`` adds nothing;
        0 for a mean over none); ``"stack"`` and ``"concat"`` hold every evaluated
        micro-batch's values. Floating sums and means are computed and returned in at least
        float32, integer sums in the leaf's dtype, integer means in float32; ``"max"``,
        ``"min"``, ``"last"``, ``"stack"`` and ``"concat"`` keep the leaf's dtype.
      weighted: ``fun`` returns ``(loss, weight)`` (with aux ``((loss, weight), aux)``): the
        mean over the micro-batch's valid items and their count; the result is the exact mean
        over all valid items of the batch.
      skip_nonfinite: leave out every micro-batch whose loss or gradient holds a NaN or an
        infinity and renormalise over the others (0 if none remains; the steps then make no
        update). Without it a NaN propagates to the result: nothing is masked silently.
      accumulator_dtype: the dtype gradients and losses are summed in (never narrower than a
        leaf); ``None`` sums in each leaf's own dtype.
      mesh: data parallelism: a one-axis ``jax.sharding.Mesh`` (all of it data), or a
        :class:`DataParallel` naming the data axes, the FSDP choice and parameter shardings.
      noise_scale: also estimate the gradient noise scale (McCandlish et al. 2018, appendix
        A) from the micro-batch gradients' squared norms (each device's own, before the one
        reduction) and the step's gradient: a :class:`jaxaccum.NoiseScale` in
        ``StepInfo.noise_scale`` (steps always return the info; a ``value_and_grad`` needs
        ``return_info=True``), for a few flops per parameter per micro-batch. With
        ``weighted`` the items are what the weights count (tokens); skipped and empty
        micro-batches are no samples. At least 2 micro-batches over all devices; one device
        or Auto mesh axes with ``fsdp="step"`` (refused when built on Explicit axes or with
        ``fsdp="microbatch"``, where no device holds its own micro-batch gradient).
      unroll: the micro-batch loop's unroll (a ``jax.lax.fori_loop`` of static bounds, which
        is a ``jax.lax.scan``; default 1: a rolled loop).
        Unrolling a few iterations cuts loop overhead when micro-batches are tiny (gist MLP,
        k=64: unroll=16 1.31 ms against 1.72 ms rolled), at the price of compile time and of
        the unrolled micro-batches' activations living at once.

    The options that are gone, and why: ``remat`` (wrap the loss in ``jax.checkpoint``
    yourself; around a whole micro-batch it saved no memory in the benchmarks, the micro-batch
    already bounds the activations); ``aux_reduce`` (merged into ``has_aux``); ``data_axis``,
    ``fsdp``, ``param_shardings`` (merged into ``mesh=DataParallel(...)``). Passing one raises
    a ``TypeError`` that says what to write instead.

    Raises:
      TypeError: an option of the wrong type (a bool option given another value, ``unroll``
        not an int >= 1, ``accumulator_dtype`` not a dtype, ``mesh`` neither a mesh nor a
        :class:`DataParallel`).
      ValueError: not exactly one of the three counts, a ``has_aux`` name that is no
        reduction, a plain mesh of several axes (name the data axes with
        :class:`DataParallel`). Each error names the entry point the options were given to.
    """

    num_microbatches: int | None = None
    microbatch_size: int | None = None
    max_microbatches: int | None = None
    has_aux: HasAux = False
    weighted: bool = False
    skip_nonfinite: bool = False
    accumulator_dtype: DTypeLike | None = jnp.float32
    mesh: jax.sharding.Mesh | DataParallel | None = None
    noise_scale: bool = False
    unroll: int | bool = 1
    def __post_init__(self) -> None:
        """Every option's type and value, checked once; errors name the entry point
        :func:`parse` was called for (``jaxaccum.Options`` when built directly)."""
        entry, runtime_count = _CALLER.get()
        _validation.exactly_one_count(self.num_microbatches, self.microbatch_size, entry,
                                      self.max_microbatches, runtime_count)
        check_bool(entry, "weighted", self.weighted)
        check_bool(entry, "skip_nonfinite", self.skip_nonfinite)
        check_bool(entry, "noise_scale", self.noise_scale)
        if not (isinstance(self.unroll, (bool, np.bool_))
                or isinstance(self.unroll, (int, np.integer)) and self.unroll >= 1):
            raise TypeError(f"{entry}: unroll must be an int >= 1 or a bool; got {self.unroll!r}")
        if self.accumulator_dtype is not None:
            try:
                jnp.dtype(self.accumulator_dtype)
            except TypeError:
                raise TypeError(
                    f"{entry}: accumulator_dtype must be a dtype or None; got "
                    f"{self.accumulator_dtype!r}"
                ) from None
        if self.aux_spec is not None and not isinstance(self.has_aux, (bool, np.bool_)):
            _reductions.check_aux_spec(entry, self.aux_spec)
        if self.mesh is not None and not isinstance(self.mesh, (DataParallel, jax.sharding.Mesh)):
            raise TypeError(
                f"{entry}: mesh must be a jax.sharding.Mesh or a jaxaccum.DataParallel; got "
                f"{type(self.mesh).__name__}"
            )
        if isinstance(self.mesh, jax.sharding.Mesh) and len(self.mesh.axis_names) != 1:
            raise ValueError(
                f"{entry}: mesh has the axes {self.mesh.axis_names}; name the data axes with "
                f"mesh=jaxaccum.DataParallel(mesh, data_axis={self.mesh.axis_names[0]!r})"
            )
        self._check_noise_scale(entry)

    def _check_noise_scale(self, entry: str) -> None:
        """The meshes on which no device holds its own micro-batch gradient to measure."""
        dp = self.data_parallel
        if not self.noise_scale or dp is None:
            return
        if dp.explicit:
            raise ValueError(
                f"{entry}: noise_scale=True is not available on a mesh whose data axes "
                f"{dp.axes} are Explicit (each device's micro-batch gradient is an unreduced "
                "partial sum there); use Auto axes (jax.make_mesh(..., axis_types=(AxisType."
                "Auto, ...))) or one device"
            )
        if dp.fsdp == "microbatch":
            raise ValueError(
                f"{entry}: noise_scale=True with fsdp='microbatch': each micro-batch's "
                "gradient is reduce-scattered over the devices at once, so no device holds its "
                "own micro-batch gradient to measure; use fsdp='step'"
            )

    @property
    def aux_spec(self) -> Any:
        """The aux reduction spec, or None without aux (``True`` means ``"stack"``)."""
        if isinstance(self.has_aux, (bool, np.bool_)):  # NumPy's bools too
            return "stack" if self.has_aux else None
        return self.has_aux

    @property
    def data_parallel(self) -> DataParallel | None:
        """The mesh option as a :class:`DataParallel` (None without a mesh)."""
        if self.mesh is None or isinstance(self.mesh, DataParallel):
            return self.mesh
        return DataParallel(self.mesh)

    @property
    def divides_safely(self) -> bool:
        """Whether the total weight can be 0 (weighted, every micro-batch skipped, or a
        runtime count of 0)."""
        return self.weighted or self.skip_nonfinite or self.max_microbatches is not None


class OptionsDict(TypedDict, total=False):
    """The accumulation options as keywords: what every entry point's ``**options`` takes
    (each documented once in :class:`Options`), for type checkers and editors.

    Examples:
      >>> import jaxaccum
      >>> options: jaxaccum.OptionsDict = {"num_microbatches": 4, "has_aux": "concat"}
      >>> jaxaccum.Options(**options).has_aux
      'concat'
    """

    num_microbatches: int | None
    microbatch_size: int | None
    max_microbatches: int | None
    has_aux: HasAux
    weighted: bool
    skip_nonfinite: bool
    accumulator_dtype: DTypeLike | None
    mesh: jax.sharding.Mesh | DataParallel | None
    noise_scale: bool
    unroll: int | bool


def check_bool(entry: str, name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{entry}: {name} must be a bool; got {value!r}")


def parse(entry: str, options: Mapping[str, Any], *, runtime_count: bool = True) -> Options:
    """Builds the :class:`Options` for a call of ``entry`` (e.g. ``"jaxaccum.train_step"``;
    ``runtime_count``: whether it takes ``max_microbatches``).

    Every error names ``entry``, the option, what was expected and received, and the fix.
    """
    fields = {f.name for f in dataclasses.fields(Options)}
    for name in options:
        if name in fields:
            continue
        if name in RENAMED:
            raise TypeError(f"{entry}: the option {name}= is gone; {RENAMED[name]}")
        close = difflib.get_close_matches(name, sorted(fields), n=1)
        hint = f"did you mean {close[0]}=? " if close else ""
        raise TypeError(
            f"{entry}: unknown option {name}=; {hint}check the name against the options "
            f"{sorted(fields)} (see jaxaccum.Options)"
        )
    # the entry's name is added at this boundary, not threaded through Options' fields (which
    # are the options, all of them public): __post_init__ reads it for its messages
    token = _CALLER.set((entry, runtime_count))
    try:
        return Options(**options)
    finally:
        _CALLER.reset(token)
