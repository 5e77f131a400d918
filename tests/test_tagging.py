"""Tagging (mIOU@K): PPMI against a direct computation, mIOU by hand, and the protocol learning tags from
features that carry them (and not from features that do not)."""

import numpy as np
import pytest
from ml_collections import ConfigDict

from vlrep.evaluators import tagging


def test_ppmi_matrix_matches_direct_counts_and_embeddings_factorise_it():
  rng = np.random.default_rng(0)
  tags = (rng.random((60, 6)) < 0.35).astype(np.uint8)
  tags[:, 5] = 0  # a tag never seen
  n = len(tags)
  expect = np.zeros((6, 6))
  for i in range(6):
    for j in range(6):
      both = np.sum(tags[:, i] & tags[:, j])
      if both:
        expect[i, j] = max(0.0, np.log(n * both / (tags[:, i].sum() * tags[:, j].sum())))
  ppmi = tagging.ppmi_matrix(tags)
  np.testing.assert_allclose(ppmi, expect, rtol=1e-10)
  emb = tagging.ppmi_embeddings(tags, 4)
  assert emb.shape == (6, 4) and not emb[5].any()  # the unseen tag embeds at 0
  u, s, _ = np.linalg.svd(expect)
  np.testing.assert_allclose(emb.T @ emb, np.diag(s[:4]), atol=1e-4)  # U_d sqrt(S_d): columns orthogonal


def test_mean_iou_at_k_by_hand():
  scores = np.array([[0.9, 0.8, 0.1, 0.0], [0.1, 0.2, 0.3, 0.4], [1.0, 0.0, 0.0, 0.0]])
  gt = np.array([[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]])  # the last row has no tags: skipped
  # row 0: top-2 {0, 1} vs {0, 2}: 1/3; row 1: top-2 {3, 2} vs {3}: 1/2
  assert tagging.mean_iou_at_k(scores, gt, 2) == pytest.approx(100 * (1 / 3 + 1 / 2) / 2)
  # top-1: row 0 {0} vs {0, 2}: 1/2; row 1 {3} vs {3}: 1
  assert tagging.mean_iou_at_k(scores, gt, 1) == pytest.approx(100 * 0.75)


def test_protocol_learns_tags_from_informative_features_not_from_shuffled_ones():
  rng = np.random.default_rng(0)
  v, n_train, n_test = 12, 600, 200
  tags = (rng.random((n_train + n_test, v)) < 0.25).astype(np.uint8)
  tags[:20] = 0  # untagged images are skipped and counted
  features = tags @ rng.normal(size=(v, 32)) + 0.1 * rng.normal(size=(n_train + n_test, 32))
  config = ConfigDict(dict(tag_dim=64, hidden=64, epochs=40, lr=3e-3, train_batch_size=64, ks=(3, 5), seed=0))
  out = tagging.fit_and_score(features[:n_train], tags[:n_train], features[n_train:], tags[n_train:], config)
  assert out["untagged_train"] == np.sum(~tags[:n_train].any(1)) >= 20 and out["unseen_tags"] == 0
  assert out["miou3"] > out["prior_miou3"] + 30, out
  shuffled = rng.permutation(features[:n_train])
  bad = tagging.fit_and_score(shuffled, tags[:n_train], features[n_train:], tags[n_train:], config)
  assert bad["miou3"] < out["miou3"] - 30 and abs(bad["miou3"] - bad["prior_miou3"]) < 10, bad
