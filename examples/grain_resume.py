"""A Grain pipeline packed by jaxaccum, checkpointed with Orbax mid-epoch, killed and resumed.

A corpus of token sequences goes through Grain (``MapDataset.source -> shuffle ->
to_iter_dataset``), is packed into steps of at most M micro-batches by
``jaxaccum.grain.PackIterDataset`` and trained on by one ``max_microbatches=M`` step with a
token-mean loss (``weighted=True``). Every few steps an Orbax ``CheckpointManager`` saves the
parameters, the optimizer state and the data iterator's state (Grain's own Orbax handler:
the packer's waiting sequences included). A first job is killed (``os._exit``) mid-epoch,
after steps it had not saved; a second job resumes from the last checkpoint.

Checks: the resumed job ends with parameters bitwise equal to an uninterrupted run's, and
across the restart every sequence of the corpus is trained on exactly once.
Run: ``python examples/grain_resume.py [--smoke]`` (needs ``pip install 'jaxaccum[grain]'``).
"""

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jaxaccum
from jaxaccum.grain import PackIterDataset
from jaxaccum.packing import next_token_segments, token_mean

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--smoke", action="store_true", help="a smaller corpus")
parser.add_argument("--job", help="(internal) run one training job, checkpointing here")
parser.add_argument("--kill-at", type=int, default=-1, help="(internal) die before this step")
parser.add_argument("--out", help="(internal) where the job writes its final parameters")
args = parser.parse_args()
V, D, ROWS, L, M = 32, 16, 4, 32, 4  # vocabulary, width, rows a micro-batch, row length, max k
DOCS = 300 if args.smoke else 3000
SAVE_EVERY = 3


def corpus():  # counting mod V from a random start, 2 to L tokens long
    rng = np.random.default_rng(0)
    return [((rng.integers(V) + np.arange(rng.integers(2, L + 1))) % V).astype(np.int32)
            for _ in range(DOCS)]


def dataset():
    docs = grain.MapDataset.source(corpus()).shuffle(seed=42).to_iter_dataset()
    return PackIterDataset(docs, rows=ROWS, length=L, max_microbatches=M)


def loss_fn(p, batch):  # a bigram model: (mean over real next-token targets, how many)
    tokens, segment_ids = batch
    logits = jnp.tanh(p["embed"][tokens] @ p["hidden"]) @ p["out"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits[..., :-1, :], tokens[..., 1:])
    targets = next_token_segments(segment_ids)[..., :-1]
    return token_mean(loss, targets)


def init():
    keys = jax.random.split(jax.random.key(0), 3)
    return {"embed": jax.random.normal(keys[0], (V, D)),
            "hidden": jax.random.normal(keys[1], (D, D)) / D**0.5,
            "out": jax.random.normal(keys[2], (D, V)) / D**0.5}


optimizer = optax.adam(1e-2)
step = jaxaccum.train_step(loss_fn, optimizer, max_microbatches=M, weighted=True)


def train(directory=None, kill_at=-1):
    """Trains one epoch; with a directory, resumes from its last checkpoint and saves every
    SAVE_EVERY steps. Returns the parameters, the sequence indices trained on (their arrival
    indices in the shuffled stream) and the number of steps."""
    params = init()
    opt_state = optimizer.init(params)
    it = iter(dataset())
    t, seen = 0, []
    manager = None
    if directory is not None:
        manager = ocp.CheckpointManager(directory)
        last = manager.latest_step()
        if last is not None:
            restored = manager.restore(last, args=ocp.args.Composite(
                model=ocp.args.StandardRestore({"params": params, "opt_state": opt_state}),
                data=grain.checkpoint.CheckpointRestore(it),
                seen=ocp.args.JsonRestore()))
            params, opt_state = restored.model["params"], restored.model["opt_state"]
            t, seen = last, restored.seen["indices"]
            print(f"resumed at step {t}: {len(seen)} sequences trained on before")
    for packed in it:
        if t == kill_at:
            print(f"killed before step {t}")
            sys.stdout.flush()
            os._exit(9)  # no cleanup, no checkpoint: the steps since the last save are lost
        params, opt_state, loss, _ = step(params, opt_state, packed.microbatches(
            "tokens", "segment_ids"))
        seen += np.unique(packed.sequence_index[packed.segment_ids > 0]).tolist()
        t += 1
        if manager is not None and t % SAVE_EVERY == 0:
            manager.save(t, args=ocp.args.Composite(
                model=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                data=grain.checkpoint.CheckpointSave(it),
                seen=ocp.args.JsonSave({"indices": seen})))
            manager.wait_until_finished()
    if manager is not None:
        manager.close()
    return params, seen, t


if args.job:  # one job of the interrupted run, in its own process
    params, seen, steps = train(pathlib.Path(args.job), args.kill_at)
    np.savez(args.out, seen=np.asarray(seen), **{k: np.asarray(v) for k, v in params.items()})
    sys.exit(0)

reference, reference_seen, steps = train()
print(f"uninterrupted: {steps} steps over {DOCS} sequences, {len(reference_seen)} packed")
assert sorted(reference_seen) == list(range(DOCS))
kill_at = steps // 2 + 1
if kill_at % SAVE_EVERY == 0:  # not a multiple of SAVE_EVERY: steps after the last save are lost
    kill_at += 1
assert SAVE_EVERY < kill_at < steps, (kill_at, steps)  # a checkpoint to resume from, mid-epoch
with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "final.npz"
    command = [sys.executable, __file__, "--job", str(pathlib.Path(tmp) / "ckpt"), "--out",
               str(out), *(["--smoke"] if args.smoke else [])]
    first = subprocess.run([*command, "--kill-at", str(kill_at)], capture_output=True, text=True)
    print(first.stdout.strip())
    assert first.returncode == 9, (first.returncode, first.stderr[-3000:])
    second = subprocess.run(command, capture_output=True, text=True)
    print(second.stdout.strip())
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed at step {kill_at // SAVE_EVERY * SAVE_EVERY}:" in second.stdout
    final = dict(np.load(out))
seen = final.pop("seen").tolist()
assert sorted(seen) == list(range(DOCS)), "a sequence lost or repeated across the restart"
for name, value in reference.items():
    assert np.array_equal(final[name], np.asarray(value)), f"{name} differs after the restart"
print(f"OK: killed before step {kill_at} of {steps} and resumed from the checkpoint of step "
      f"{kill_at // SAVE_EVERY * SAVE_EVERY}: final parameters bitwise equal to the "
      f"uninterrupted run's, each of the {DOCS} sequences trained on once")
