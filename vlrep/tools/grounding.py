r"""How much a VirTex captioning head uses the image, by word group: the head's per-token negative log-likelihood
of a split's captions given each caption's own image, against the same captions given another image of the
batch (the images shifted by one). The difference ("image gain", nats per token) is what the image tells the
head about each word; a head whose gain is ~0 for a group predicts those words from the language alone.

  python -m vlrep.tools.grounding --workdir=/tmp/virtex_local [--direction=backward] [--limit=300]

Groups are synthetic_scenes' word classes (colour, size, shape; a word of several pieces is counted on each
piece); every other token is 'other'. On other datasets every token is 'other'.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from vlrep import run_setup, runs
from vlrep.data import pipeline, records, scenes, tokenizers
from vlrep.methods.virtex import reverse_captions
from vlrep.models.virtex import VirTexModel

# synthetic_scenes' word classes: what a caption says of an object's colour, size and shape.
GROUPS = {
  "colour": list(scenes.COLOR_NAMES),
  "size": [*scenes.SIZES, "biggest"],
  "shape": [word for shape in scenes.SHAPES for word in scenes.shape_words(shape)],
}


def piece_groups(tokenizer, dataset: str) -> dict[int, str]:
  """Piece id -> word group, for the pieces of synthetic_scenes' attribute and shape words."""
  if dataset != "synthetic_scenes":
    return {}
  out = {}
  for group, words in GROUPS.items():
    for pieces in tokenizer.encode_words(words):
      for piece in pieces:
        out.setdefault(piece, group)
  return out


def image_gain(
  workdir: str, split: str = "val", limit: int = 300, direction: str = "forward", checkpoint: str = "latest"
) -> dict[str, dict[str, float]]:
  """{group: {'tokens', 'matched', 'shuffled', 'gain'}}: mean NLL (nats) per token with the caption's own image and
  with the next image of its batch, over every caption of the first `limit` examples of `split`."""
  if direction not in ("forward", "backward"):
    raise ValueError(f"direction must be 'forward' or 'backward', not {direction!r}.")
  run = runs.load_run(workdir, checkpoint)
  if run.config.method.name != "virtex" or run.config.method.task not in ("bicaptioning", "captioning", "cappa"):
    raise ValueError(f"{workdir} is not a VirTex captioning run (method {run.config.method.name}).")
  if direction == "backward" and run.config.method.task != "bicaptioning":
    raise ValueError("--direction=backward needs a bicaptioning run.")
  builder, inputs = run_setup.build(run.config)
  method, tokenizer = inputs.method, inputs.tokenizer
  groups = piece_groups(tokenizer, run.config.data.name)
  max_len = run.config.method.max_len
  variables = jax.device_put(run.variables)

  @jax.jit
  def token_nll(images, tokens):
    visual = method.model.apply(variables, images, method=VirTexModel.project_visual)
    logits, _ = method.model.apply(variables, visual, tokens[:, :-1], direction, method=VirTexModel.text_logits)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]

  sums = {"matched": collections.Counter(), "shuffled": collections.Counter()}
  counts = collections.Counter()
  examples = records.first_examples(builder, split, limit)
  for batch in pipeline.eval_batches(builder, examples, "decode|normalize", ("image", "captions"), 100):
    real = batch["_mask"].astype(bool)
    if real.sum() < 2:
      continue
    images = batch["image"][real]
    captions = np.array(batch["captions"], dtype=object).reshape(len(real), -1)[real]
    for column in captions.T:
      tokens = np.stack([tokenizer.encode(c.decode(), max_len)[0] for c in column])
      if direction == "backward":
        tokens = np.asarray(reverse_captions(jnp.asarray(tokens)))
      targets = tokens[:, 1:]
      keep = (targets != tokenizers.PAD_ID) & (column != b"")[:, None]
      names = np.vectorize(lambda t: groups.get(int(t), "other"), otypes=[object])(targets)
      for key, imgs in (("matched", images), ("shuffled", np.roll(images, 1, axis=0))):
        nll = np.asarray(token_nll(imgs, tokens))
        for group in set(names[keep]):
          sel = keep & (names == group)
          sums[key][group] += float(nll[sel].sum())
          if key == "matched":
            counts[group] += int(sel.sum())
  out = {}
  for group, n in counts.items():
    matched, shuffled = sums["matched"][group] / n, sums["shuffled"][group] / n
    out[group] = {"tokens": n, "matched": matched, "shuffled": shuffled, "gain": shuffled - matched}
  return out


def main(argv):
  del argv
  f = flags.FLAGS
  result = image_gain(f.workdir, f.split, f.limit, f.direction, f.checkpoint)
  print(f"{'group':8s} {'tokens':>7s} {'own image':>10s} {'other image':>12s} {'image gain':>11s}  (nats/token)")
  for group, r in sorted(result.items()):
    print(f"{group:8s} {r['tokens']:7d} {r['matched']:10.3f} {r['shuffled']:12.3f} {r['gain']:+11.3f}")


if __name__ == "__main__":
  flags.DEFINE_string("workdir", None, "A VirTex bicaptioning, captioning or cappa run's directory.")
  flags.DEFINE_string("split", "val", "Split whose captions are scored.")
  flags.DEFINE_integer("limit", 300, "First examples of the split (0: all).")
  flags.DEFINE_enum("direction", "forward", ["forward", "backward"], "Which captioning model.")
  flags.DEFINE_string("checkpoint", "latest", "'best', 'latest' or a step number.")
  flags.mark_flags_as_required(["workdir"])
  app.run(main)
