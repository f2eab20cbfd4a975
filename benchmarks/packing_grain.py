"""jaxaccum's packers against Grain's: throughput, fill and (offline) peak memory.

Packs 14 seeded synthetic corpora (token ids int32 in [1, 32000)) into rows of T tokens:

- lengths ``zipf`` (``ceil(T * u**0.1 / r)``, r ~ Zipf(1.5) capped at T, u ~ U(0, 1): a third
  near-full, the rest short), ``uniform`` (uniform in [1, T]) and ``longtail`` (lognormal,
  median T/8, sigma 1, clipped to [1, T]); T = 128 and 2048; 10^4 and 10^5 sequences (12);
- ``docs``: ~1000-token documents (normal(1000, 200) clipped to [1, 2048]), T = 2048, 10^4 and
  10^5 documents (a 10^5 corpus whose slowest method takes over 60 s in the warm-up is
  regenerated with 3 * 10^4; the results say so).

Methods, all producing arrays of 64 rows of T tokens a step (jaxaccum: ``(M, rows, T) =
(8, 8, T)``; Grain: its rows batched with ``.batch(64)``):

- ``pack``: ``jaxaccum.packing.pack`` (best-fit decreasing over the whole corpus, one output);
- ``pack_epoch``: ``jaxaccum.packing.pack_epoch`` (the same plan, one step at a time);
- ``pack_stream``: ``jaxaccum.packing.pack_stream`` (online best fit, ``lookahead=64``);
- ``jaxaccum_grain``: ``jaxaccum.grain.PackIterDataset`` (the same, as a Grain transformation,
  ``lookahead=64``, ``key="tokens"``);
- ``grain_first_fit``, ``grain_best_fit``: ``grain.experimental.FirstFitPackIterDataset`` /
  ``BestFitPackIterDataset`` (``num_packing_bins=64``, defaults otherwise: bins shuffled);
- ``grain_concat_split``: ``grain.experimental.ConcatThenSplitIterDataset`` (it splits
  sequences across rows: its fill is ~1 by construction, not comparable to the others').

The Grain pipelines (Grain's packers and ``PackIterDataset``) read
``grain.MapDataset.source([{"tokens": seq}, ...]).to_iter_dataset(ReadOptions(num_threads=0))``
(in-memory data: no reader threads, as Grain recommends); ``pack*`` take the list of arrays.
``source_only`` is that Grain source iterated without packing, for reference; and
``output_only`` allocates (NumPy) and pads four int32 arrays of the corpus's lower-bound
rows (``ceil(tokens / T)`` rows of T tokens) on one thread: what a packer that returns the
whole corpus at once must at least write, measured in the same rounds (its time depends on
what the operating system's fresh memory costs just then; ``pack`` maps its output and pads
it on a second thread, ahead of the rows it writes).

Measured per corpus and method, in interleaved rounds (every method once a round, each
round in its own seeded random order; medians): the throughput (corpus tokens / seconds to
consume the whole corpus: every step or batch is produced, its real tokens counted, then
dropped); the fill
(real tokens / slots of the rows produced: for jaxaccum over the ``num_microbatches`` used
micro-batches of each output, as ``Packed.fill``; for Grain over the rows of its batches, the
last partial batch counting only its rows); the peak traced memory (``tracemalloc``, NumPy
included, plus the output arrays ``pack`` maps outside it) of ``pack`` and ``pack_epoch`` in a
separate untimed run. A warm-up round first
checks every output: each corpus token exactly once (jaxaccum: per-sequence token counts via
``sequence_index`` and every real token equal to the corpus token at its sequence and
position; Grain: the real-token count, the sums of the token ids and of their squares, and for
the two whole-sequence packers the histogram of positions, i.e. the multiset of lengths).

About 10 minutes on 2 quiet CPU cores (``--quick``: about 1.5 minutes). Writes
results/packing_grain.json and results/packing_grain.md.

    python benchmarks/packing_grain.py [--quick] [--rounds-small 3] [--rounds-big 3]
    python benchmarks/packing_grain.py --profile uniform-2048-100000 pack_stream
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import mmap
import pstats
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import grain
import grain.experimental as gx
import numpy as np
from _common import machine, result_path, save

from jaxaccum import grain as jgrain
from jaxaccum import packing

ROWS, M, BINS, LOOKAHEAD, VOCAB = 8, 8, 64, 64, 32000
JAXACCUM = ("pack", "pack_epoch", "pack_stream", "jaxaccum_grain")
GRAIN = ("grain_first_fit", "grain_best_fit", "grain_concat_split")
WHOLE = ("grain_first_fit", "grain_best_fit")  # Grain's packers that keep sequences whole
METHODS = JAXACCUM + GRAIN
REFERENCE = "source_only"
OUTPUT = "output_only"  # the whole corpus's rows allocated and padded, for reference
SLOW_S = 60.0
REDUCED = 30_000


# --- corpora --------------------------------------------------------------------------------


def lengths_of(kind: str, T: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "zipf":
        rank = np.minimum(rng.zipf(1.5, n), T)
        lens = np.ceil(T * rng.random(n) ** 0.1 / rank)
    elif kind == "uniform":
        lens = rng.integers(1, T + 1, n)
    elif kind == "longtail":
        lens = np.ceil(rng.lognormal(math.log(T / 8), 1.0, n))
    elif kind == "docs":
        lens = np.rint(rng.normal(1000, 200, n))
    else:
        raise ValueError(kind)
    return np.clip(lens, 1, T).astype(np.int64)


class Corpus:
    """Sequences as views of one flat int32 array (``flat``), ``starts``/``lengths`` each."""

    def __init__(self, kind: str, T: int, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.kind, self.T, self.n = kind, T, n
        self.name = f"{kind}-{T}-{n}"
        self.lengths = lengths_of(kind, T, n, rng)
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.tokens = int(self.lengths.sum())
        self.flat = rng.integers(1, VOCAB, self.tokens, dtype=np.int32)
        self.seqs = np.split(self.flat, np.cumsum(self.lengths)[:-1])
        self.dicts = [{"tokens": s} for s in self.seqs]
        flat64 = self.flat.astype(np.int64)
        self.sum, self.sum_sq = int(flat64.sum()), int((flat64 * flat64).sum())
        # tokens at position p: the sequences longer than p
        self.pos_hist = np.bincount(self.lengths, minlength=T + 1)[::-1].cumsum()[::-1][1:]


def source(c: Corpus) -> grain.IterDataset:
    read = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    return grain.MapDataset.source(c.dicts).to_iter_dataset(read)


def outputs(method: str, c: Corpus) -> Iterator[Any]:
    """The method's outputs over the whole corpus: Packed (jaxaccum) or dict batches (Grain)."""
    T = c.T
    if method == "pack":
        return iter([packing.pack(c.seqs, rows=ROWS, length=T)])
    if method == "pack_epoch":
        return packing.pack_epoch(c.seqs, rows=ROWS, length=T, max_microbatches=M)
    if method == "pack_stream":
        return packing.pack_stream(iter(c.seqs), rows=ROWS, length=T, max_microbatches=M,
                                   lookahead=LOOKAHEAD)
    if method == "jaxaccum_grain":
        return iter(jgrain.PackIterDataset(source(c), rows=ROWS, length=T, max_microbatches=M,
                                           lookahead=LOOKAHEAD, key="tokens"))
    if method == "grain_first_fit":
        ds = gx.FirstFitPackIterDataset(source(c), length_struct={"tokens": T},
                                        num_packing_bins=BINS)
    elif method == "grain_best_fit":
        ds = gx.BestFitPackIterDataset(source(c), length_struct={"tokens": T},
                                       num_packing_bins=BINS)
    elif method == "grain_concat_split":
        ds = gx.ConcatThenSplitIterDataset(source(c), length_struct={"tokens": T})
    elif method == REFERENCE:
        return iter(source(c))
    else:
        raise ValueError(method)
    return iter(ds.batch(BINS))


# --- consuming ------------------------------------------------------------------------------


def consume(method: str, c: Corpus) -> dict[str, int]:
    """Consumes every output, keeping none: real tokens, slots and outputs."""
    if method == OUTPUT:
        rows = -(-c.tokens // c.T)
        out = [np.full((rows, c.T), value, np.int32) for value in (0, 0, 0, -1)]
        return {"real": c.tokens, "slots": sum(a.size for a in out) // 4, "outputs": 1}
    real = slots = count = mapped = 0
    if method == REFERENCE:
        for element in outputs(method, c):
            real += element["tokens"].size
            count += 1
        return {"real": real, "slots": real, "outputs": count}
    for out in outputs(method, c):
        count += 1
        if isinstance(out, packing.Packed):
            mapped = max(mapped, mapped_bytes(out))
            k = out.num_microbatches
            real += int(np.count_nonzero(out.segment_ids[:k]))
            slots += k * ROWS * c.T
        else:
            seg = out["tokens_segment_ids"]
            real += int(np.count_nonzero(seg))
            slots += seg.size
    return {"real": real, "slots": slots, "outputs": count, "mapped": mapped}


def mapped_bytes(out: packing.Packed) -> int:
    """The bytes of the output's arrays that live in memory maps, which tracemalloc does not
    see (``pack`` maps a large output rather than allocating it through NumPy)."""
    total = 0
    for a in out[:4]:
        base = a
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        if isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap):
            total += base.nbytes
    return total


def verify(method: str, c: Corpus) -> dict[str, Any]:
    """The warm-up: consumes the method's outputs checking every corpus token appears once."""
    if method in (REFERENCE, OUTPUT):
        return {"ok": consume(method, c)["real"] == c.tokens}
    per_seq = np.zeros(c.n, np.int64)
    real_n = mismatched = tok_sum = tok_sq = 0
    pos_hist = np.zeros(c.T, np.int64)
    for out in outputs(method, c):
        if isinstance(out, packing.Packed):
            k = out.num_microbatches
            real = out.segment_ids[:k] > 0
            si = out.sequence_index[:k][real]
            pos = out.positions[:k][real]
            tok = out.tokens[:k][real]
            per_seq += np.bincount(si, minlength=c.n)
            mismatched += int(np.count_nonzero(tok != c.flat[c.starts[si] + pos]))
            if np.any(out.segment_ids[k:] != 0):
                mismatched += 1
        else:
            real = out["tokens_segment_ids"] > 0
            tok = out["tokens"][real].astype(np.int64)
            pos = out["tokens_positions"][real]
            tok_sum += int(tok.sum())
            tok_sq += int((tok * tok).sum())
            pos_hist += np.bincount(pos, minlength=c.T)
        real_n += int(np.count_nonzero(real))
    if method in JAXACCUM:
        ok = real_n == c.tokens and np.array_equal(per_seq, c.lengths) and not mismatched
        return {"ok": bool(ok), "check": "per-sequence counts + every token at its position"}
    ok = real_n == c.tokens and tok_sum == c.sum and tok_sq == c.sum_sq
    check = "token count, sum and sum of squares"
    if method in WHOLE:
        ok = ok and np.array_equal(pos_hist, c.pos_hist)
        check += " + position histogram (multiset of lengths)"
    return {"ok": bool(ok), "check": check}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def peak_memory(method: str, c: Corpus) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        mapped = consume(method, c)["mapped"]
        return tracemalloc.get_traced_memory()[1] + mapped
    finally:
        tracemalloc.stop()


# --- the run --------------------------------------------------------------------------------


def specs(quick: bool) -> list[tuple[str, int, int]]:
    sizes = (10_000,) if quick else (10_000, 100_000)
    out = [(kind, T, n) for kind in ("zipf", "uniform", "longtail") for T in (128, 2048)
           for n in sizes]
    return out + [("docs", 2048, n) for n in sizes]


def run_corpus(kind: str, T: int, n: int, seed: int, rounds: int) -> dict[str, Any]:
    methods = (*METHODS, REFERENCE, OUTPUT)
    c = Corpus(kind, T, n, seed)
    note = None
    warm = {m: timed(lambda m=m: verify(m, c)) for m in methods}
    slowest = max(warm, key=lambda m: warm[m][0])
    if n > REDUCED and warm[slowest][0] > SLOW_S:
        note = (f"reduced from {n} to {REDUCED} sequences: {slowest} took "
                f"{warm[slowest][0]:.0f} s in the warm-up (> {SLOW_S:.0f} s)")
        print("  " + note, flush=True)
        del c
        c = Corpus(kind, T, REDUCED, seed)
        warm = {m: timed(lambda m=m: verify(m, c)) for m in methods}
    for m, (_, check) in warm.items():
        if not check["ok"]:
            raise AssertionError(f"{c.name}: {m} failed its check ({check})")
    times: dict[str, list[float]] = {m: [] for m in methods}
    counts: dict[str, dict[str, int]] = {}
    # each round in its own seeded random order: the time to get fresh memory from the
    # operating system depends on what ran before (pack's output is GBs on the big corpora)
    order = random.Random(f"{kind}-{T}-{n}")
    for _ in range(rounds):
        for m in order.sample(methods, len(methods)):
            t, counts[m] = timed(lambda m=m: consume(m, c))
            times[m].append(t)
            assert counts[m]["real"] == c.tokens, (c.name, m, counts[m])
    entry: dict[str, Any] = {
        "corpus": c.name, "kind": kind, "T": T, "sequences": c.n, "tokens": c.tokens,
        "mean_length": c.tokens / c.n, "corpus_mib": c.flat.nbytes / 2**20,
        "lower_bound_rows": -(-c.tokens // T), "note": note, "rounds": rounds, "methods": {},
    }
    for m in methods:
        med = statistics.median(times[m])
        cnt = counts[m]
        entry["methods"][m] = {
            "seconds": times[m], "median_s": med, "mtok_per_s": c.tokens / med / 1e6,
            "fill": cnt["real"] / cnt["slots"], "outputs": cnt["outputs"],
            "rows": cnt["slots"] // T, "warmup_s": warm[m][0], "check": warm[m][1],
        }
    grain_best = max(GRAIN, key=lambda g: entry["methods"][g]["mtok_per_s"])
    whole_best = max(WHOLE, key=lambda g: entry["methods"][g]["mtok_per_s"])
    entry["best_grain"], entry["best_grain_whole"] = grain_best, whole_best
    entry["best_grain_whole_fill"] = max(entry["methods"][g]["fill"] for g in WHOLE)
    for m in JAXACCUM:
        e = entry["methods"][m]
        e["ratio_best_grain"] = e["mtok_per_s"] / entry["methods"][grain_best]["mtok_per_s"]
        e["ratio_best_grain_whole"] = (e["mtok_per_s"]
                                       / entry["methods"][whole_best]["mtok_per_s"])
    for m in ("pack", "pack_epoch"):
        entry["methods"][m]["peak_mib"] = peak_memory(m, c) / 2**20
    return entry


def markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# jaxaccum's packers against Grain's (benchmarks/packing_grain.py)", "",
        f"{payload['machine']['processor']}, {payload['machine']['cpu_count']} CPUs, grain "
        f"{payload['grain']}; wall {payload['wall_s'] / 60:.1f} min"
        f"{' (--quick)' if payload['quick'] else ''}. Rows of T tokens, 64 a step: jaxaccum "
        "(M, rows) = (8, 8), lookahead 64; Grain num_packing_bins=64, .batch(64). Medians of "
        "interleaved rounds; the ratio is to the fastest Grain packer on the corpus (†: "
        "ConcatThenSplit, which splits sequences). Fill: real tokens / slots of the rows "
        "produced (jaxaccum: the used micro-batches; Grain: its batches' rows). Peak: "
        "tracemalloc peak of one pack / pack_epoch run beyond the corpus, plus the output "
        "arrays pack maps outside tracemalloc's view.", "",
        "## Throughput (M tokens/s), ratio to the best Grain packer", "",
        "| corpus | tokens | " + " | ".join(METHODS) + " | source_only | output_only |",
        "| --- | ---: | " + " | ".join("---:" for _ in METHODS) + " | ---: | ---: |",
    ]
    for e in payload["corpora"]:
        ms = e["methods"]
        cells = []
        for m in METHODS:
            cell = f"{ms[m]['mtok_per_s']:.2f}"
            if m in JAXACCUM:
                cell += f" ({ms[m]['ratio_best_grain']:.2f}x)"
            elif m == e["best_grain"]:
                cell = f"**{cell}**" + ("†" if m == "grain_concat_split" else "")
            cells.append(cell)
        name = e["corpus"] + (" *" if e["note"] else "")
        lines.append(f"| {name} | {e['tokens'] / 1e6:.1f}M | " + " | ".join(cells)
                     + f" | {ms[REFERENCE]['mtok_per_s']:.1f} | {ms[OUTPUT]['mtok_per_s']:.1f} |")
    lines += ["", "## Fill (real tokens / slots), rows produced; peak memory (MiB)", "",
              "| corpus | lower-bound rows | " + " | ".join(METHODS)
              + " | pack peak | pack_epoch peak | corpus MiB |",
              "| --- | ---: | " + " | ".join("---:" for _ in METHODS) + " | ---: | ---: | ---: |"]
    for e in payload["corpora"]:
        ms = e["methods"]
        cells = [f"{ms[m]['fill']:.4f} ({ms[m]['rows']})" for m in METHODS]
        lines.append(f"| {e['corpus']} | {e['lower_bound_rows']} | " + " | ".join(cells)
                     + f" | {ms['pack']['peak_mib']:.0f} | {ms['pack_epoch']['peak_mib']:.1f}"
                     f" | {e['corpus_mib']:.1f} |")
    notes = [f"- {e['corpus']}: {e['note']}" for e in payload["corpora"] if e["note"]]
    flags = payload["flags"]
    lines += ["", "## Below 3x the best Grain packer's throughput, or below its fill", ""]
    lines += [f"- {f}" for f in flags] or ["- none"]
    if notes:
        lines += ["", "## Notes", "", *notes]
    return "\n".join(lines) + "\n"


def flags_of(corpora: list[dict[str, Any]]) -> list[str]:
    out = []
    for e in corpora:
        ms = e["methods"]
        for m in JAXACCUM:
            r = ms[m]["ratio_best_grain"]
            if r < 3:
                out.append(f"{e['corpus']}: {m} {ms[m]['mtok_per_s']:.2f} M tok/s = {r:.2f}x "
                           f"{e['best_grain']} ({ms[e['best_grain']]['mtok_per_s']:.2f})")
            if ms[m]["fill"] < e["best_grain_whole_fill"]:
                out.append(f"{e['corpus']}: {m} fill {ms[m]['fill']:.4f} < Grain whole-sequence "
                           f"best {e['best_grain_whole_fill']:.4f}")
    return out


def profile(name: str, method: str) -> None:
    kind, T, n = name.rsplit("-", 2)
    c = Corpus(kind, int(T), int(n), seed=specs(False).index((kind, int(T), int(n))))
    consume(method, c)  # warm
    prof = cProfile.Profile()
    prof.runcall(consume, method, c)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
    print(buf.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10^4-sequence corpora, 2 rounds")
    parser.add_argument("--rounds-small", type=int, default=3)
    parser.add_argument("--rounds-big", type=int, default=3)
    parser.add_argument("--profile", nargs=2, metavar=("CORPUS", "METHOD"),
                        help="cProfile one method on one corpus (e.g. docs-2048-100000 pack)")
    args = parser.parse_args()
    if args.profile:
        profile(*args.profile)
        return
    start = time.perf_counter()
    corpora = []
    for seed, (kind, T, n) in enumerate(specs(False)):
        if args.quick and n > 10_000:
            continue
        rounds = 2 if args.quick else (args.rounds_small if n <= 10_000 else args.rounds_big)
        t0 = time.perf_counter()
        entry = run_corpus(kind, T, n, seed, rounds)
        corpora.append(entry)
        ms = entry["methods"]
        print(f"{entry['corpus']} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
            f"{m} {ms[m]['mtok_per_s']:.2f}/{ms[m]['fill']:.3f}" for m in METHODS), flush=True)
    payload = {
        "benchmark": "packing_grain", "machine": machine(), "grain": grain_version(),
        "quick": args.quick, "rows": ROWS, "max_microbatches": M, "num_packing_bins": BINS,
        "grain_batch": BINS, "lookahead": LOOKAHEAD, "corpora": corpora,
        "flags": flags_of(corpora), "wall_s": time.perf_counter() - start,
    }
    print(f"wrote {save('packing_grain', payload)}")
    path = result_path("packing_grain", "md")
    path.write_text(markdown(payload))
    print(f"wrote {path}")


def grain_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("grain")
    except metadata.PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main()
