"""Feedback divergences vs float64 NumPy: directions, top-k + tail, JSD endpoints, masks, stop-gradient."""

import jax
import numpy as np
import pytest

from composer_jax.rl import divergence

B, T, V = 2, 5, 11


def _logits(seed):
  rng = np.random.default_rng(seed)
  student = rng.normal(0, 2.0, (B, T, V)).astype(np.float32)
  teacher = (student + rng.normal(0, 1.5, (B, T, V))).astype(np.float32)
  mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], np.float32)
  return student, teacher, mask


def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_kl(la, lb):
  return (np.exp(la) * (la - lb)).sum(-1)


def _np_loss(student, teacher, mask, kind, top_k=None, beta=0.5):
  ls, lt = _np_log_softmax(student), _np_log_softmax(teacher)
  if top_k is not None:
    ids = np.argsort(-ls, axis=-1)[..., :top_k]
    ls, lt = (np.take_along_axis(x, ids, -1) for x in (ls, lt))
    ls, lt = (
      np.concatenate([x, np.log(np.maximum(1 - np.exp(x).sum(-1, keepdims=True), 1e-6))], -1)
      for x in (ls, lt)
    )
  ps, pt = np.exp(ls), np.exp(lt)
  if kind == "reverse_kl":
    d = _np_kl(ls, lt)
  elif kind == "forward_kl":
    d = _np_kl(lt, ls)
  else:
    lm = np.log(beta * pt + (1 - beta) * ps)
    d = beta * _np_kl(lt, lm) + (1 - beta) * _np_kl(ls, lm)
  return (d * mask).sum(), mask.sum()


CASES = [
  ("reverse_kl", None, 0.5),
  ("forward_kl", None, 0.5),
  ("jsd", None, 0.5),
  ("jsd", None, 0.1),
  ("reverse_kl", 3, 0.5),
  ("forward_kl", 3, 0.5),
  ("jsd", 3, 0.7),
]


@pytest.mark.parametrize("kind,top_k,beta", CASES)
def test_matches_numpy_float64(kind, top_k, beta):
  student, teacher, mask = _logits(0)
  s, c = divergence.feedback_loss(student, teacher, mask, kind=kind, top_k=top_k, beta=beta)
  rs, rc = _np_loss(student, teacher, mask, kind, top_k, beta)
  assert rs > 1e-2  # the distributions differ: a loss of zero would not pass
  np.testing.assert_allclose(float(s), rs, rtol=1e-5)
  assert float(c) == rc


def test_zero_when_teacher_equals_student():
  student, _, mask = _logits(1)
  for kind, top_k, beta in CASES:
    s, _ = divergence.feedback_loss(student, student, mask, kind=kind, top_k=top_k, beta=beta)
    assert abs(float(s)) < 1e-6, (kind, top_k, beta)


@pytest.mark.parametrize("kind,top_k", [("reverse_kl", None), ("forward_kl", None), ("jsd", 4)])
def test_no_teacher_gradient_and_masked_positions_inert(kind, top_k):
  student, teacher, mask = _logits(2)
  f = jax.jit(
    jax.value_and_grad(lambda s, t: divergence.feedback_loss(s, t, mask, kind=kind, top_k=top_k)[0], (0, 1))
  )
  v, (gs, gt) = f(student, teacher)
  assert np.all(np.asarray(gt) == 0.0)
  off = mask == 0
  assert np.all(np.asarray(gs)[off] == 0.0) and np.any(np.asarray(gs)[~off] != 0.0)
  junk = np.where(off[..., None], np.nan, 0.0).astype(np.float32)
  v2, (gs2, _) = f(student + junk, teacher + junk)
  assert float(v2) == float(v)
  np.testing.assert_array_equal(np.asarray(gs2), np.asarray(gs))


def test_forward_kl_gradient_is_p_student_minus_p_teacher():
  # d KL(P_T‖P_S) / d student logits = P_S - P_T: an independent closed form.
  student, teacher, mask = _logits(3)
  g = jax.grad(lambda s: divergence.feedback_loss(s, teacher, mask, kind="forward_kl")[0])(student)
  ref = (np.exp(_np_log_softmax(student)) - np.exp(_np_log_softmax(teacher))) * mask[..., None]
  np.testing.assert_allclose(np.asarray(g), ref, atol=1e-6)


def test_jsd_endpoints_and_limits():
  student, teacher, mask = _logits(4)

  def loss(kind, beta=0.5):
    return float(divergence.feedback_loss(student, teacher, mask, kind=kind, beta=beta)[0])

  fwd, rev = loss("forward_kl"), loss("reverse_kl")
  assert loss("jsd", 0.0) == fwd and loss("jsd", 1.0) == rev
  # Inside (0, 1) JSD_β vanishes at both ends at the rate of the endpoint's direction.
  b = 1e-3
  np.testing.assert_allclose(loss("jsd", b) / b, fwd, rtol=2e-2)
  np.testing.assert_allclose(loss("jsd", 1 - b) / b, rev, rtol=2e-2)


def test_bad_arguments_raise():
  student, teacher, mask = _logits(5)
  with pytest.raises(ValueError, match="reverse_kl, forward_kl, jsd"):
    divergence.feedback_loss(student, teacher, mask, kind="kl")
  with pytest.raises(ValueError, match="beta"):
    divergence.feedback_loss(student, teacher, mask, kind="jsd", beta=1.5)
  with pytest.raises(ValueError, match="top_k"):
    divergence.feedback_loss(student, teacher, mask, top_k=0)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl"])
def test_clip_caps_each_token_and_scales_its_gradient(kind):
  student, teacher, mask = _logits(5)
  d = np.asarray(divergence.token_divergence(student, teacher, mask, kind=kind))
  c = float(np.median(d[mask > 0]))  # some tokens above the cap, some below
  dc = np.asarray(divergence.token_divergence(student, teacher, mask, kind=kind, clip=c))
  np.testing.assert_allclose(dc, np.minimum(d, c) * (mask > 0), rtol=1e-5, atol=1e-6)

  def grad(clip):
    return np.asarray(
      jax.grad(lambda s: divergence.token_divergence(s, teacher, mask, kind=kind, clip=clip).sum())(student)
    )

  g, gc = grad(None), grad(c)
  # Per token: the same direction, scaled by min(1, c / D_t).
  scale = np.where(d > c, c / np.maximum(d, 1e-12), 1.0)[..., None]
  np.testing.assert_allclose(gc, g * scale, rtol=1e-4, atol=1e-6)
  with pytest.raises(ValueError, match="clip"):
    divergence.token_divergence(student, teacher, mask, clip=0.0)
