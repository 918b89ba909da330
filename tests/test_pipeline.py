"""The pipeline around the stages: stage-level resume (a finished stage is skipped with the same config,
rerun when its config or an upstream stage changed, started over on `force`; an interrupted stage leaves
no marker), the end-of-run summary built from the stages' summaries, and synth → sft → rl on the coding env
over the tasks the synth stage cut from the fixture repository of tests/test_synth_tasks.py."""

import dataclasses
import json
import logging
import pathlib

import pytest
import tiny

from composer_jax import pipeline, report, stages


def _config(stages: str):
  c = tiny.load_script("experiments/composer25.py").get_config("tiny")
  c.stages = stages
  return c


@pytest.fixture
def fake_stages(monkeypatch):
  """demo, sft and rl replaced by stubs that record their calls and write one output file each."""
  calls = []

  def stub(name, out):
    def fn(config, workdir):
      calls.append(name)
      pathlib.Path(workdir, out).write_text("{}")
      return {"loss": float(config.demo.batch), "uniform_loss": 6.9, "steps": config.sft.schedule.steps}

    return fn

  for name, out in (("demo", "demo.json"), ("sft", "sft.json"), ("rl", "rl.json")):
    monkeypatch.setitem(
      stages.REGISTRY, name, dataclasses.replace(stages.REGISTRY[name], run=stub(name, out))
    )
  return calls


@pytest.fixture
def logs(caplog):
  """The run's absl log lines (INFO and up) as text."""
  caplog.set_level(logging.INFO)
  return caplog


def test_finished_stage_is_skipped_and_rerun_when_its_config_changes(tmp_path, fake_stages, logs):
  c = _config("demo")
  first = pipeline.run(c, str(tmp_path))
  second = pipeline.run(c, str(tmp_path))
  assert fake_stages == ["demo"] and second == first
  assert "demo: finished" in logs.text
  logs.clear()
  marker = json.loads((tmp_path / "stages" / "demo.json").read_text())
  assert marker["summary"]["loss"] == 4.0 and marker["config"]["demo"]["batch"] == 4

  c.demo.batch = 8
  assert pipeline.run(c, str(tmp_path))["demo"]["loss"] == 8.0
  assert fake_stages == ["demo", "demo"] and "demo.batch: 4 -> 8" in logs.text
  (previous,) = (tmp_path / "stages" / "previous").iterdir()  # the old outputs, moved aside, not deleted
  assert sorted(p.name for p in previous.iterdir()) == ["demo.json", "marker.json"]

  c.force = "demo"  # the same config, started over
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["demo"] * 3 and len(list((tmp_path / "stages" / "previous").iterdir())) == 2


def test_rerunning_an_upstream_stage_reruns_the_stages_that_read_it(tmp_path, fake_stages, logs):
  c = _config("sft,rl")
  pipeline.run(c, str(tmp_path))
  c.sft.schedule.steps = 3  # sft runs again (in place), so rl (which starts from its checkpoint) must too
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "rl", "sft", "rl"]
  assert (
    "sft: config changed since it finished (sft.schedule.steps: 300 -> 3): continuing in place" in logs.text
  )
  c.rl.schedule.steps = 1  # rl alone
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "rl", "sft", "rl", "rl"]
  assert "rl.schedule.steps: 30 -> 1): continuing in place" in logs.text
  c.rl.schedule.warmup_steps = 1  # not cadence: the learning rate of the steps taken differs
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "rl", "sft", "rl", "rl", "rl"]
  assert "rl.schedule.warmup_steps: 3 -> 1): starting over" in logs.text
  c.force = "sft"  # sft again with the same config: rl starts from a new checkpoint, so it reruns too
  pipeline.run(c, str(tmp_path))
  assert fake_stages == ["sft", "rl", "sft", "rl", "rl", "rl", "sft", "rl"]


def test_interrupted_stage_leaves_no_marker_and_keeps_the_finished_ones(tmp_path, fake_stages, monkeypatch):
  def interrupted(config, workdir):
    raise stages.Interrupted("pretrain stopped at step 3")  # what a stage does on Ctrl-C, after saving

  pretrain = dataclasses.replace(stages.REGISTRY["pretrain"], run=interrupted)
  monkeypatch.setitem(stages.REGISTRY, "pretrain", pretrain)
  with pytest.raises(stages.Interrupted):
    pipeline.run(_config("demo,pretrain,sft"), str(tmp_path))
  assert sorted(p.name for p in (tmp_path / "stages").glob("*.json")) == ["demo.json"]
  assert list(json.loads((tmp_path / "summary.json").read_text())["stages"]) == ["demo"]
  assert fake_stages == ["demo"]


def test_summary_from_stage_summaries(tmp_path):
  hist = lambda rewards, invalid, fb: [  # noqa: E731
    dict(
      step=i + 1,
      reward=r,
      pass_rate=r,
      invalid_call_rate=v,
      feedback_turns_per_rollout=fb,
      feedback_kl=0.1 * fb,
    )
    for i, (r, v) in enumerate(zip(rewards, invalid, strict=True))
  ]
  results = {
    "pretrain": dict(
      start_step=0,
      steps=60,
      first_train_loss=6.9,
      last_train_loss=2.5,
      first_validation_loss=6.9,
      last_validation_loss=2.6,
    ),
    "synth": dict(total_valid=2, sources=[dict(name="inflection", valid=2, candidates=3, error="")]),
    "sft": dict(
      steps=60,
      first_loss=5.7,
      last_loss=0.4,
      eval_sampled=dict(pass_rate=0.1, invalid_call_rate=0.2),
      eval_greedy=dict(pass_rate=0.3, invalid_call_rate=0.0),
    ),
    "rl": dict(
      steps=6,
      lambda_feedback=0.5,
      history=hist([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.3] * 3 + [0.5] * 3, 1.0),
      evals=[dict(step=s, reward=r, invalid_call_rate=0.1) for s, r in ((0, 0.25), (3, 0.3), (6, 0.45))],
      without_feedback=dict(
        steps=6,
        lambda_feedback=0.0,
        history=hist([0.1] * 6, [0.3] * 6, 0.0),
        evals=[dict(step=s, reward=0.25, invalid_call_rate=v) for s, v in ((0, 0.1), (3, 0.2), (6, 0.3))],
      ),
    ),
  }
  runs = {k: dict(seconds=10.0, skipped=k == "pretrain", finished="then") for k in results}
  rep = report.build(results, runs, str(tmp_path))
  st = rep["stages"]
  assert st["pretrain"]["checkpoints"] == str(tmp_path / "checkpoints") and rep["seconds_this_run"] == 30.0
  assert st["synth"]["tasks"] == 2 and st["synth"]["candidates"] == 3
  assert st["sft"]["sampled"]["invalid_call_rate"] == 0.2
  rl = st["rl"]  # 6 steps: windows of 2
  assert rl["window"] == 2 and rl["reward"] == pytest.approx(dict(first=0.15, last=0.55))
  assert (
    rl["invalid_call_rate"] == pytest.approx(dict(first=0.3, last=0.5))
    and rl["feedback_turns_per_rollout"] == 1
  )
  assert (
    rl["without_feedback"]["feedback_kl"] == 0.0 and rl["without_feedback"]["eval"]["last"]["reward"] == 0.25
  )
  assert rl["eval"]["first"]["reward"] == 0.25 and rl["eval"]["last"] == dict(
    step=6, reward=0.45, invalid_call_rate=0.1
  )
  assert rl["effect"] == pytest.approx(
    dict(where="fixed problems at step 6", reward=0.2, invalid_call_rate=-0.2, ahead=True)
  )
  text = report.write(rep, str(tmp_path))
  assert json.loads((tmp_path / "summary.json").read_text()) == rep
  wants = ["train loss 6.900 -> 2.500", "2 tasks built of 3 candidates", "sampled pass 0.10"]
  wants += ["invalid-call rate 0.300 -> 0.500", "pretrain 10 s", "fixed problems, step 0 -> 6:"]
  wants += ["RL + feedback (lambda 0.5):    reward 0.250 -> 0.450, invalid-call rate 0.100 -> 0.100"]
  wants += ["RL alone, same seeds:          reward 0.250 -> 0.250, invalid-call rate 0.100 -> 0.300"]
  wants += [
    "feedback effect (fixed problems at step 6, with - without): reward +0.200, invalid-call rate -0.200: "
  ]
  assert all(w in text for w in wants), text


# The few-thousand-parameter model of tests/test_rl_loop.py, as `model` overrides.
_TINY_RL = dict(d_model=32, n_heads=2, dense_mlp_dim=64, moe_mlp_dim=16, q_lora_rank=16, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)  # fmt: skip


def test_synth_sft_rl_on_coding_tasks_then_all_skipped(tmp_path, monkeypatch, logs):
  from test_synth_tasks import fixture_env

  from composer_jax.synth import build, sandbox

  if not sandbox.available():
    pytest.skip("bubblewrap/prlimit not installed")
  src, venv = fixture_env()
  monkeypatch.setattr(build, "ensure_venv", lambda *_: venv)  # the fixture's venv, built once per machine
  c = _config("synth,sft,rl")
  c.synth.update(sources="", local_dir=str(src), max_tasks_per_source=1, runs=1)
  # 267: exactly the byte tokenizer's ids. An untrained model over the default 272 samples ids 267-271,
  # which the byte tokenizer cannot decode (KeyError in the coding env: the step fails).
  c.model.update(_TINY_RL, vocab_size=267)
  # From a random init (no pretrain stage here); 0 eval problems: no evaluation.
  c.sft.update(init="random", batch_size=4, demos=16, eval_problems=0)
  c.sft.schedule.update(steps=2, log_every=1)
  c.rl.update(env="coding", problems_per_step=1, group_size=2, max_turns=1, max_turn_tokens=16)
  c.rl.schedule.steps = 1
  c.rl.update(cache_len=4096, lambda_feedback=0.5, compare_without_feedback=False)
  c.rl.coding.output_chars = 400
  out = pipeline.run(c, str(tmp_path))

  assert out["synth"]["total_valid"] == 1 and (tmp_path / "synth_tasks").exists()
  assert out["sft"]["steps"] == 2 and "eval_greedy" not in out["sft"]
  rl = out["rl"]
  (h,) = rl["history"]
  assert rl["steps"] == 1 and rl["failed_steps"] == 0 and h["failed_rollouts"] == 0, rl
  assert (tmp_path / "rl" / "1").exists() and len(list((tmp_path / "rl_episodes").iterdir())) == 1
  rep = json.loads((tmp_path / "summary.json").read_text())
  assert rep["stages"]["synth"]["tasks"] == 1 and rep["stages"]["rl"]["reward"]["first"] == h["reward"]
  assert f"weights from sft checkpoint {tmp_path}/sft/2" in logs.text
  logs.clear()

  again = pipeline.run(c, str(tmp_path))  # everything finished: nothing recomputed
  assert logs.text.count("with this config: skipped") == 3 and again == json.loads(json.dumps(out))
  assert json.loads((tmp_path / "summary.json").read_text())["seconds_this_run"] == 0


def test_synth_rebuild_reuses_finished_pypi_sources(tmp_path, monkeypatch):
  from composer_jax.synth import build, sources, tasks

  built_sources = []

  def fake_build_source(src_obj, cache, row, built, mode, max_tasks, runs, timeout_s, log):
    built_sources.append(src_obj.name)
    (tmp_path / "repo").mkdir(exist_ok=True)
    repo = str(tmp_path / "repo")
    fields = dict(feature=("f",), mode=mode, patch="", gold_patch="", fail_to_pass=("t",), pass_to_pass=())
    fields |= dict(hidden_tests=(), statement="", created_at="", repo_dir=repo, venv=repo, test_files={})
    built.append(tasks.Task(f"{src_obj.name}-1", {"name": src_obj.name}, **fields))
    row.candidates, row.valid = 1, 1

  monkeypatch.setattr(build, "_build_source", fake_build_source)
  monkeypatch.setattr(build, "_write", lambda built, d: str(d))
  a, b = sources.DEFAULT_SOURCES[:2]
  kw = dict(max_tasks_per_source=1, log=lambda _: None, done_dir=tmp_path / "done")
  build.build([a], tmp_path, **kw)
  summary = build.build([a, b], tmp_path, **kw)  # a source added: the finished one is reused
  assert built_sources == [a.name, b.name] and summary["total_valid"] == 2
  assert [r["valid"] for r in summary["sources"]] == [1, 1]
  build.build([a, b], tmp_path, **(kw | dict(max_tasks_per_source=2)))  # other settings: rebuilt
  assert built_sources == [a.name, b.name, a.name, b.name]


def test_rl_history_keeps_training_steps_and_evaluations_apart(tmp_path):
  """An evaluation written at step s must not replace step s's training record (and vice versa)."""
  from composer_jax.stages import rl
  from composer_jax.train import metrics

  w = metrics.MetricsWriter(tmp_path)
  w.write(0, {"eval_reward": 0.25, "eval_invalid_call_rate": 0.1})
  for s in (1, 2):
    w.write(s, {"reward": 0.1 * s, "invalid_call_rate": 0.3})
  w.write(2, {"eval_reward": 0.5, "eval_invalid_call_rate": 0.05})
  w.write(2, {"reward": 0.7, "invalid_call_rate": 0.2})  # step 2 redone after a resume: the newest wins
  w.write(3, {"loss": 0.4})  # an SFT record: neither a training step of RL nor an evaluation
  w.close()
  path = tmp_path / "metrics.jsonl"
  assert [(r["step"], r["reward"]) for r in metrics.read_history(path, "reward")] == [(1, 0.1), (2, 0.7)]
  assert metrics.read_history(path, "loss") == [dict(step=3, loss=0.4)]
  assert rl.eval_history(path) == [
    dict(step=0, reward=0.25, invalid_call_rate=0.1),
    dict(step=2, reward=0.5, invalid_call_rate=0.05),
  ]


def test_a_stage_without_its_upstream_checkpoint_names_the_stage_to_run(tmp_path):
  """sft on a fresh workdir (no pretrain checkpoint, no init_from): one line naming the stage to run first;
  with a checkpoint of another model: one line naming the fields that differ."""
  from composer_jax import configs
  from composer_jax.stages import weights

  config = configs.from_config(_config("sft"))
  with pytest.raises(
    weights.MissingUpstream, match=r"no pretrain checkpoint under .* run stage pretrain first"
  ):
    weights.starting_params(config, str(tmp_path), "pretrain", None)
  saved = {"d_model": 128, "n_layers": 2}
  assert weights.model_identity(saved | {"remat": "full", "dtype": "bfloat16"}) == saved  # how, not what
