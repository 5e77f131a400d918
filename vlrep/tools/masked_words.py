r"""Masked-token top-1 of an ICMLM run broken down by word group (what the image helps with).

  python -m vlrep.tools.masked_words --workdir=/tmp/icsweep/icmlm_att_fc

Uses the run's own `masked_tokens` evaluator config (split, pp, limit, captions). Groups are synthetic_scenes'
word classes (colour, size, shape); every other concept word is 'other'.
"""

from __future__ import annotations

import collections

import numpy as np
from absl import app, flags

from vlrep import evaluate, runs
from vlrep.data import pipeline, records
from vlrep.data.builders import scenes
from vlrep.evaluators.masked_tokens import MaskedTokens

GROUPS = {
  "colour": list(scenes.COLOR_NAMES),
  "size": [*scenes.SIZES, "biggest"],
  "shape": [word for shape in scenes.SHAPES for word in scenes.shape_words(shape)],
}


def word_accuracy(workdir: str, checkpoint: str = "latest") -> dict[str, tuple[int, float]]:
  """{group: (occurrences, top-1 %)} over the run's masked-token evaluation set."""
  import jax

  run = runs.load_run(workdir, checkpoint)
  run_inputs = evaluate.run_inputs_of(run)
  cfg = run.config.evals.masked_tokens
  ev = MaskedTokens(cfg, run_inputs)
  split = records.first_examples(ev.builder, cfg.split, cfg.get("limit", 0))
  variables = jax.device_put(run.variables)
  predict = jax.jit(lambda v, x, t, p: ev.method.predict_masked(v, x, t, p).argmax(-1))
  hits, counts = collections.Counter(), collections.Counter()
  for batch in pipeline.eval_batches(ev.builder, split, cfg.pp, ("image", "captions"), cfg.batch_size):
    real = batch["_mask"].astype(bool)
    caps = np.array(batch["captions"], dtype=object).reshape(len(real), -1)
    caps[~real] = b""
    rows, toks, pos = ev.triplets(caps)
    for s in range(0, len(rows), cfg.batch_size):
      r, t, p = rows[s : s + cfg.batch_size], toks[s : s + cfg.batch_size], pos[s : s + cfg.batch_size]
      out = np.asarray(predict(variables, batch["image"][r], t, p))
      for k in range(len(r)):
        word = run_inputs.tokenizer.pieces[t[k, p[k]]]
        group = next((g for g, ws in GROUPS.items() if word in ws), "other")
        counts[group] += 1
        hits[group] += int(out[k] == t[k, p[k]])
  return {g: (counts[g], 100.0 * hits[g] / max(counts[g], 1)) for g in counts}


def main(argv):
  del argv
  for group, (n, acc) in sorted(word_accuracy(flags.FLAGS.workdir, flags.FLAGS.checkpoint).items()):
    print(f"{group:8s} {n:5d} occurrences  top-1 {acc:5.1f}%")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "The ICMLM run's directory.")
  flags.DEFINE_string("checkpoint", "latest", "'best', 'latest' or a step number.")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
