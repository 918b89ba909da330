"""Curriculum: retirement, preference for harder tasks, deterministic state round trip, input errors."""

import json

import numpy as np
import pytest

from composer_jax.synth.curriculum import Curriculum, CurriculumConfig

IDS = [f"pkg-1.0__featdel__mod.f{i}__stub" for i in range(6)]


def test_binary_credit_and_decayed_pass_rate():
  cur = Curriculum(IDS, decay=0.5)
  cur.update(IDS[0], [1.0, 0.0, 0.5, 1.0])  # 0.5 is partial credit: not a pass
  s = cur.stats(IDS[0])
  assert (s.attempts, s.passes, cur.pass_rate(IDS[0])) == (4, 2.0, 0.5)
  cur.update(IDS[0], [0.0, 0.0])  # the old group counts half: (0.5*2 + 0) / (0.5*4 + 2)
  assert cur.pass_rate(IDS[0]) == pytest.approx(0.25)
  mean = Curriculum(IDS, credit="mean")
  mean.update(IDS[0], [0.5, 0.25])
  assert mean.pass_rate(IDS[0]) == pytest.approx(0.375)
  assert cur.pass_rate(IDS[1]) is None


def test_retired_solved_tasks_never_sampled():
  cur = Curriculum(IDS, min_attempts=8, solved_threshold=0.9)
  assert cur.update(IDS[0], [1.0] * 4) is None  # too few attempts to retire
  assert cur.update(IDS[0], [1.0] * 4) == "solved"
  assert cur.retired == {IDS[0]: "solved"}
  cur.update(IDS[0], [0.0] * 8)  # late rollouts do not revive it
  rng = np.random.default_rng(0)
  drawn = {i for _ in range(200) for i in cur.sample(3, rng)}
  assert IDS[0] not in drawn and drawn == set(IDS[1:])


def test_unsolvable_tasks_retire_after_many_zero_attempts():
  cur = Curriculum(IDS[:2], unsolvable_attempts=16)
  cur.update(IDS[0], [0.0] * 8)
  assert cur.active() == IDS[:2]
  assert cur.update(IDS[0], [0.0] * 8) == "unsolvable"
  cur.update(IDS[1], [1.0] + [0.0] * 15)  # passed once: hard, not unsolvable
  assert cur.retired == {IDS[0]: "unsolvable"} and cur.active() == [IDS[1]]


def test_harder_tasks_sampled_more_often():
  # Statistical with a fixed seed: hard (1/8 pass) vs easy (7/8 pass), both active.
  cur = Curriculum(["hard", "easy"], min_attempts=100)
  cur.update("hard", [1.0] + [0.0] * 7)
  cur.update("easy", [1.0] * 7 + [0.0])
  rng = np.random.default_rng(1234)
  draws = [cur.sample(1, rng)[0] for _ in range(2000)]
  hard = draws.count("hard") / len(draws)
  w = cur.weights()
  assert hard == pytest.approx(w["hard"] / (w["hard"] + w["easy"]), abs=0.04)
  assert hard > 0.75


def test_unseen_tasks_get_exploration_prior():
  cur = Curriculum(["seen", "new"], unseen_weight=1.0)
  cur.update("seen", [0.0] * 8)
  w = cur.weights()
  assert w["new"] == 1.0 and w["seen"] < 1.0


def test_state_round_trip_gives_identical_future_samples(tmp_path):
  cur = Curriculum(IDS, decay=0.7, temperature=0.5)
  rng = np.random.default_rng(7)
  for k, i in enumerate(IDS[:4]):
    cur.update(i, [1.0] * k + [0.0] * (8 - k))
  cur.update(IDS[5], [1.0] * 8)
  path = tmp_path / "curriculum.json"
  cur.save(path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["curriculum.json"]  # no temp file left
  back = Curriculum.load(path)
  json.dumps(back.state_dict())
  assert back.state_dict() == cur.state_dict()
  assert back.config == cur.config and back.retired == cur.retired
  state = rng.bit_generator.state
  a = [cur.sample(3, rng) for _ in range(20)]
  rng2 = np.random.default_rng()
  rng2.bit_generator.state = state
  b = [back.sample(3, rng2) for _ in range(20)]
  assert a == b
  cur.update(IDS[1], [0.5, 1.0])
  back.update(IDS[1], [0.5, 1.0])
  assert cur.sample(4, np.random.default_rng(3)) == back.sample(4, np.random.default_rng(3))


def test_save_overwrites_atomically(tmp_path):
  path = tmp_path / "c.json"
  Curriculum(["a"]).save(path)
  Curriculum(["a", "b"]).save(path)
  assert len(Curriculum.load(path)) == 2


def test_bad_inputs_raise():
  cur = Curriculum(IDS[:2])
  with pytest.raises(KeyError, match="unknown instance id 'nope'"):
    cur.update("nope", [1.0])
  with pytest.raises(ValueError, match=r"in \[0, 1\]"):
    cur.update(IDS[0], [1.5])
  with pytest.raises(ValueError, match=r"in \[0, 1\]"):
    cur.update(IDS[0], [-0.1, 0.0])
  with pytest.raises(ValueError, match=r"in \[0, 1\]"):
    cur.update(IDS[0], [float("nan")])
  with pytest.raises(ValueError, match="non-empty"):
    cur.update(IDS[0], [])
  with pytest.raises(ValueError, match="duplicate"):
    cur.add([IDS[0]])
  with pytest.raises(ValueError, match="no active tasks"):
    Curriculum([]).sample(1, np.random.default_rng(0))
  with pytest.raises(ValueError, match="distinct"):
    cur.sample(3, np.random.default_rng(0))
  with pytest.raises(TypeError, match="Generator"):
    cur.sample(1, 0)
  with pytest.raises(ValueError, match="credit"):
    CurriculumConfig(credit="median")
  with pytest.raises(ValueError, match="version"):
    Curriculum.from_state_dict({"version": 99})


def test_all_retired_pool_reports_why():
  cur = Curriculum(["a"], min_attempts=1)
  cur.update("a", [1.0])
  with pytest.raises(ValueError, match="1 retired"):
    cur.sample(1, np.random.default_rng(0))
