"""What XLA and JAX do not do (yet) for jaxaccum, in one place: the convolution layout XLA:CPU
leaves naive in loop bodies (``conv_layout``), re-evaluating a jaxpr equation by equation
(``jaxpr``), reduced parameters on Explicit meshes (``reduced``), and counting collectives in
compiled HLO text (``hlo``, for tests and benchmarks)."""
