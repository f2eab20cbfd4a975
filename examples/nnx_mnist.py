"""The Flax NNX MNIST tutorial, with its batch of 32 split into 4 micro-batches of 8.

One line of the tutorial's train step changes: ``nnx.value_and_grad(loss_fn, has_aux=True)``
becomes ``jaxaccum.nnx.value_and_grad(loss_fn, has_aux="concat", num_microbatches=4)``.
``has_aux="concat"`` hands the logits back in the batch's own order, so the tutorial's
``metrics.update(loss=..., logits=..., labels=...)`` runs unchanged.

Checks: on the first batch the loss, logits, gradients and metrics equal the full-batch step's;
then training lowers the loss. Run: ``python examples/nnx_mnist.py [--smoke]``.

MNIST is read as ``jaxaccum-gist`` reads it: prepared once by tensorflow-datasets in its
data_dir (``--data-dir``, default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``) and reused
by every later run. The first run downloads the four MNIST files, or offline takes them from
``--manual-dir`` (default ``$JAXACCUM_MNIST_DIR``).
"""

import argparse
from functools import partial

import jax
import numpy as np
import optax
import tensorflow_datasets as tfds
from flax import nnx

import jaxaccum.nnx
from jaxaccum.experiment import data

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="a few steps on the test split only")
data.add_arguments(parser)  # --data-dir, --manual-dir: those of jaxaccum-gist
args = parser.parse_args()
steps, eval_every = (20, 20) if args.smoke else (1200, 200)  # the tutorial's 1200 steps

tfds.disable_progress_bar()
try:
    if args.smoke:  # the test split only (2 s to read; all 70,000 images take ~10 s)
        images, labels = data.mnist("test", data_dir=args.data_dir, manual_dir=args.manual_dir)
        train, test = (images[1000:], labels[1000:]), (images[:1000], labels[:1000])
    else:
        train, test = (data.mnist(split, data_dir=args.data_dir, manual_dir=args.manual_dir)
                       for split in ("train", "test"))
except (data.MnistDownloadError, ValueError) as e:  # offline without files, a bad file
    raise SystemExit(f"nnx_mnist.py: {str(e).splitlines()[0]}") from None


def batches(split, size, seed):  # shuffled {"image": (size, 28, 28, 1), "label": (size,)}
    order = np.random.default_rng(seed).permutation(len(split[1]))
    for i in range(0, len(order) - size + 1, size):
        idx = order[i:i + size]
        yield {"image": split[0][idx].reshape(-1, 28, 28, 1), "label": split[1][idx]}


class CNN(nnx.Module):  # the tutorial's model, as it is
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.conv1(x)))
        x = self.avg_pool(nnx.relu(self.conv2(x)))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):  # the mean loss over the examples it is given, and the logits
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


# The only change to the tutorial: the gradient function.
grad_fn = jaxaccum.nnx.value_and_grad(loss_fn, has_aux="concat", num_microbatches=4)


@nnx.jit
def train_step(model, optimizer, metrics, batch):
    (loss, logits), grads = grad_fn(model, batch)  # was nnx.value_and_grad(loss_fn, has_aux=True)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
    loss, logits = loss_fn(model, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def new_metrics():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def rel(a, b):  # max |a - b| over max |b|, over whole pytrees
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True)) / max(
        float(np.max(np.abs(y))) for y in b)


model = CNN(rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
metrics = new_metrics()
train_batches = batches(train, 32, seed=0)
first = next(train_batches)

# Check 1: on the first batch, the accumulated (loss, logits) and gradients are the full
# batch's. float32 sums of 32 examples in another order differ by ~1e-7 relative; 1e-5 leaves
# room. A wrong accumulation is far off: a sum for a mean is 4x (relative error 3); logits
# out of batch order (strided, as the micro-batches hold them) belong to other examples.
(loss, logits), grads = nnx.jit(grad_fn)(model, first)
(ref_loss, ref_logits), ref_grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(
    model, first)
errors = {"loss": rel(loss, ref_loss), "logits": rel(logits, ref_logits),
          "grads": rel(grads, ref_grads)}
print("first batch, accumulated vs full batch (relative):",
      ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
assert all(v < 1e-5 for v in errors.values()), errors

# Check 2: the tutorial's metrics after the first train step are what the full batch reports.
ref_metrics = new_metrics()
ref_metrics.update(loss=ref_loss, logits=ref_logits, labels=first["label"])
train_step(model, optimizer, metrics, first)
got, want = metrics.compute(), ref_metrics.compute()
assert float(got["accuracy"]) == float(want["accuracy"]), (got, want)  # same argmax, 32 of 32
assert abs(float(got["loss"]) - float(want["loss"])) <= 1e-5 * float(want["loss"]), (got, want)

history = []
for step, batch in enumerate(train_batches, start=2):
    train_step(model, optimizer, metrics, batch)
    if step % eval_every == 0 or step == steps:
        train_metrics = {k: float(v) for k, v in metrics.compute().items()}
        metrics.reset()
        for test_batch in batches(test, 500, seed=1):  # the tutorial evaluates on all of test
            eval_step(model, metrics, test_batch)
        test_metrics = {k: float(v) for k, v in metrics.compute().items()}
        metrics.reset()
        history.append((step, train_metrics, test_metrics))
        print(f"step {step:5d}: train loss {train_metrics['loss']:.4f} accuracy "
              f"{train_metrics['accuracy']:.4f} | test loss {test_metrics['loss']:.4f} accuracy "
              f"{test_metrics['accuracy']:.4f}")
    if step == steps:
        break

# Check 3: it learns. The initial loss is ~log(10) = 2.3; the tutorial reaches ~98% test accuracy.
assert history[-1][2]["loss"] < 0.8 * float(ref_loss), history[-1]
if not args.smoke:
    assert history[-1][2]["accuracy"] > 0.95, history[-1]
print(f"the tutorial's CNN, {steps} steps of 32 images (4 micro-batches of 8) on "
      f"{len(train[1]):,} training images: loss {float(ref_loss):.3f} at the start -> test "
      f"loss {history[-1][2]['loss']:.3f}, test accuracy {history[-1][2]['accuracy']:.1%} "
      f"({len(test[1]):,} images)")
print("OK: accumulated step equals the full batch's on batch 1, and training lowers the loss")
