"""`decoding='virtex_official'` reproduces kdexd/virtex's own beam search, token for token.

tests/fixtures/virtex_official/ was written by tests/official_virtex_fixture.py running the official code (its
`BidirectionalCaptioningModel`, `TransformerDecoderTextualHead` and `AutoRegressiveBeamSearch`, from a fetched
copy) on a tiny randomly initialised model: the checkpoint in the model zoo's layout, its vocabulary, six images and
the official predictions for beam sizes 5, 3 and 1. Here the checkpoint goes through `vlrep.interop.import_run
--format=virtex` and vlrep's captioner decodes the same images.
"""

import json
import os

import jax
import numpy as np
import pytest
from conftest import ROOT

from vlrep import decoding, methods, runs, visualize
from vlrep.data import tokenizers
from vlrep.interop import import_run

FIXTURE = os.path.join(ROOT, "tests", "fixtures", "virtex_official")


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("official") / "run")
  # As `python -m vlrep.interop.import_run --format=virtex --checkpoint=... --vocab=... --heads=2` (the head count has
  # no
  # shape; tests/test_imported_commands.py runs the command line itself).
  import_run.import_run("virtex", f"{FIXTURE}/bicaptioning_tiny.pth", workdir, vocab=f"{FIXTURE}/vocab.model", heads=2)
  run = runs.load_run(workdir)
  method = methods.build(run.config.method, tokenizers.Tokenizer(run.config.tokenizer.path, "virtex").vocab_size)
  with np.load(os.path.join(FIXTURE, "captured.npz")) as f:
    captured = dict(f)
  with open(os.path.join(FIXTURE, "captured.json")) as f:
    meta = json.load(f)
  return run, method, captured, meta


def _official_as_vlrep(tokens: np.ndarray) -> np.ndarray:
  """Official predictions ([EOS] repeated to the end) in vlrep's ids and layout ([PAD] after the first [EOS])."""
  ours = tokenizers.virtex_ids_to_vlrep(tokens)
  after = (np.cumsum(ours == decoding.EOS, 1) - (ours == decoding.EOS)) > 0
  return np.where(after, decoding.PAD, ours)


def _decode(run, method, images, name, max_len, **kwargs):
  caption = decoding.make_captioner(method.model, max_len, name, **kwargs)
  return np.asarray(caption(run.variables, visualize.normalize(images), jax.random.PRNGKey(0))[0])


def test_official_decoding_reproduces_the_official_beam_search(imported):
  run, method, captured, meta = imported
  assert run.config.method.official_padding  # imported runs treat <unk> as the official head does
  images, steps = captured["images"], meta["max_steps"]
  # The captured head inputs: [SOS] alone first, then the predicted words without [SOS].
  first = meta["head_inputs_first_steps_image0_beam0"]
  assert first[0] == [1] and len(first[1]) == 1 and first[1][0] != 1 and len(first[2]) == 2
  for k in meta["beam_sizes"]:
    theirs = _official_as_vlrep(captured[f"tokens_beam{k}"])
    ours = _decode(run, method, images, "virtex_official", steps, beam_size=k)
    print(f"beam {k}: official {theirs.tolist()}\n        vlrep    {ours.tolist()}")
    np.testing.assert_array_equal(ours, theirs)
  # The fixture exercises what makes the official search differ: captions that end early and ones that run to the
  # last step, and vlrep's own beam search decodes other captions from the same model.
  lengths = (_official_as_vlrep(captured["tokens_beam5"]) != decoding.PAD).sum(1)
  assert lengths.min() < 3 and lengths.max() == steps
  vlrep_beam = _decode(run, method, images, "beam", steps - 1, beam_size=5)
  assert not np.array_equal(vlrep_beam[:, : steps - 1], _official_as_vlrep(captured["tokens_beam5"])[:, : steps - 1])

  # The two candidates per beam matter here too: with five, other captions.
  wide = _decode(run, method, images, "virtex_official", steps, beam_size=5, per_node_beam_size=5)
  assert not np.array_equal(wide, _official_as_vlrep(captured["tokens_beam5"]))


@pytest.mark.parametrize("height, width", [(300, 451), (451, 300), (480, 640)])
def test_the_official_transform_rounds_the_resized_size_as_albumentations(tmp_path, height, width):
  """albumentations' SmallestMaxSize(256) rounds the long side (py3round): 300x451 -> 256x385, where truncating
  gives 384 and moves the centre crop by half a pixel, changing the photo's pixels wholesale (issue 77)."""
  from PIL import Image
  from skimage import data as photos

  photo = np.asarray(Image.fromarray(photos.astronaut()).resize((width, height)))
  path = str(tmp_path / "photo.png")
  Image.fromarray(photo).save(path)
  out = visualize.load_image_official(path)

  def crop_of(long_side):
    resized = visualize.resize_bilinear(photo, *((256, long_side) if height < width else (long_side, 256)))
    top, left = (resized.shape[0] - 224) // 2, (resized.shape[1] - 224) // 2
    return resized[top : top + 224, left : left + 224].astype(int)

  rounded = round(max(height, width) * 256 / min(height, width))
  np.testing.assert_array_equal(out, crop_of(rounded))
  truncated = int(max(height, width) * 256 / min(height, width))
  if truncated != rounded:  # 300x451: 384.85 -> 385, where truncation gave 384 and other pixels
    assert np.abs(crop_of(truncated) - out).mean() > 1
