"""The README, CONTRIBUTING.md and docs/ name only what exists: files, stages, config keys, commands, and
sections of the markdown they link to; and every accelerator install line is the same one.

Read from the markdown itself: paths anywhere in the text, `--config.x.y` keys and `--config.stages=` /
`--config.force=` values, dotted names that start at a config section (`rl.teacher`: a config key, or
`rl.sampler`: a module), "the `x` stage", and every `python run.py ...` / `python benchmarks/....py ...`
command with its flags. A renamed module, a removed key or a stage that a page still names fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import re
import typing

import pytest

from composer_jax import configs, stages

_ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted([_ROOT / "README.md", _ROOT / "CONTRIBUTING.md", *(_ROOT / "docs").glob("*.md")])
_TOP = ("composer_jax", "tests", "benchmarks", "docs", "experiments", "notebooks", "scripts", ".ci")
_PACKAGES = tuple(
  p.name for p in (_ROOT / "composer_jax").iterdir() if p.is_dir() and p.name != "__pycache__"
)
_PATH = re.compile(
  r"(?<![\w./<>-])((?:" + "|".join(map(re.escape, _TOP + _PACKAGES)) + r")/[\w./*-]*"
  r"|run\.py|pyproject\.toml|README\.md|CONTRIBUTING\.md)"
)
_FILE_SUFFIXES = {"py", "md", "json", "jsonl", "toml", "ipynb", "txt", "png", "orbax"}
_COMMAND = re.compile(r"python3? ((?:run|benchmarks/[\w/]+)\.py)((?:\s+(?:--|-|\w)[^\s`|#]*)*)")


def _code(text: str) -> list[str]:
  """Inline code spans and fenced blocks (continuation lines joined), outside which commands and keys
  are prose."""
  blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
  rest = re.sub(r"```.*?```", "", text, flags=re.S)
  return [b.replace("\\\n", " ") for b in blocks] + re.findall(r"`([^`\n]+)`", rest)


def _config_key(path: str) -> bool:
  """`a.b.c` is a field of `configs.Config`, of its section `a`, of that section's `b`, ..."""
  node: object = configs.Config
  for part in path.split("."):
    if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
      return False
    node = typing.get_type_hints(node)[part]
  return True


def _library_name(path: str) -> bool:
  """`a.b.c` is composer_jax.a.b.c: a module, or an attribute of the longest module prefix."""
  parts = path.split(".")
  for i in range(len(parts), 0, -1):
    module = "composer_jax." + ".".join(parts[:i])
    try:
      if importlib.util.find_spec(module) is None:
        continue
    except ModuleNotFoundError:
      continue
    obj = importlib.import_module(module)
    for attr in parts[i:]:
      if not hasattr(obj, attr):
        return False
      obj = getattr(obj, attr)
    return True
  return False


def _anchors(page: pathlib.Path) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
  seen: dict[str, int] = {}
  out = set()
  for heading in re.findall(r"^#+\s+(.+)$", page.read_text(), re.M):
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def _path_problems(text: str, page: pathlib.Path) -> list[str]:
  problems = []
  for raw in _PATH.findall(re.sub(r"\w+://\S+", "", text)):
    path = raw.rstrip(".,:;)")
    if "<" in path or "{" in path:
      continue
    base = _ROOT if path.split("/")[0] in _TOP or "/" not in path else _ROOT / "composer_jax"
    if not (list(base.glob(path.rstrip("/"))) if "*" in path else (base / path).exists()):
      problems.append(f"{page.name}: no such file {path}")
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if re.match(r"\w+://", target):
      continue
    file, _, anchor = target.partition("#")
    where = (page.parent / file).resolve() if file else page
    if not where.exists():
      problems.append(f"{page.name}: link to a missing {target}")
    elif anchor and anchor not in _anchors(where):
      problems.append(f"{page.name}: no section #{anchor} in {file or page.name}")
  return problems


def _key_problems(code: list[str], page: pathlib.Path) -> list[str]:
  problems = []
  names = {f.name for f in dataclasses.fields(configs.Config)}
  for span in code:
    for key in re.findall(r"--config\.([\w.]+)", span):
      if not _config_key(key):
        problems.append(f"{page.name}: no config key {key}")
    for option, value in re.findall(r"--config\.(stages|force)=([\w,]+)", span):
      known = set(stages.REGISTRY) | ({"all"} if option == "force" else set())
      problems += [f"{page.name}: no stage {s!r} ({option})" for s in value.split(",") if s not in known]
    dotted = re.fullmatch(r"(\w+(?:\.\w+)+)(?:=\S*)?", span.strip())
    if dotted and dotted.group(1).split(".")[0] in names:
      name = dotted.group(1)
      if name.rsplit(".", 1)[1] not in _FILE_SUFFIXES and not (_config_key(name) or _library_name(name)):
        problems.append(f"{page.name}: {name} is neither a config key nor a library name")
  return problems


def _stage_problems(text: str, page: pathlib.Path) -> list[str]:
  named = re.findall(r"`(\w+)` stages?\b|\bstage `(\w+)`", text)
  named += (
    [(s, "") for s in re.findall(r"^- \*\*([a-z]+)\*\*:", text, re.M)] if page.name == "README.md" else []
  )
  return [f"{page.name}: no stage {a or b!r}" for a, b in named if (a or b) not in stages.REGISTRY]


def _run_flags() -> set[str]:
  source = (_ROOT / "run.py").read_text()
  names = set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source))
  return names | {f"no{n}" for n in names} | {"config"}


def _command_problems(code: list[str], page: pathlib.Path) -> list[str]:
  problems = []
  for span in code:
    for script, args in _COMMAND.findall(span):
      if not (_ROOT / script).exists():
        problems.append(f"{page.name}: no script {script}")
        continue
      source = (_ROOT / script).read_text()
      for flag in re.findall(r"(?:^|\s)--([\w-]+)", args):
        known = flag in _run_flags() if script == "run.py" else f'"--{flag}"' in source
        if not known and not flag.startswith("config."):
          problems.append(f"{page.name}: {script} has no flag --{flag}")
      if script == "run.py":
        problems += _experiment_problems(args, page)
  return problems


def _experiment_problems(args: str, page: pathlib.Path) -> list[str]:
  found = re.search(r"--config=([\w./]+)(?::(\w+))?", args)
  if not found:
    return []
  path, variant = _ROOT / found.group(1), found.group(2)
  if not path.exists():
    return [f"{page.name}: no config file {found.group(1)}"]
  spec = importlib.util.spec_from_file_location("experiment", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if variant and variant not in module.VARIANTS:
    return [f"{page.name}: {found.group(1)} has no variant {variant!r}"]
  return []


def problems(text: str, page: pathlib.Path) -> list[str]:
  """Everything `text` (the markdown of `page`) names that does not exist."""
  code = _code(text)
  return (
    _path_problems(text, page)
    + _key_problems(code, page)
    + _stage_problems(text, page)
    + _command_problems(code, page)
  )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(_ROOT).as_posix())
def test_the_page_names_only_what_exists(page):
  assert problems(page.read_text(), page) == []


def test_one_install_line_per_accelerator():
  """Every page that installs for an accelerator installs the same extras: one line for TPU, one for GPU."""
  extras = {
    found
    for page in PAGES
    for line in page.read_text().replace('"', "'").splitlines()
    if "pip install" in line
    for found in re.findall(r"'\.\[([\w,]+)\]'", line)
    if re.match(r"(tpu|cuda12)\b", found)
  }
  assert extras == {"tpu,kernels", "cuda12,kernels"}, extras


def test_the_readme_is_short_and_keeps_the_ci_command():
  readme = (_ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 150
  ci = (_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
  assert ci in readme, ci
  assert "bash .ci/setup && .venv/bin/python run.py --config=experiments/composer25.py" in readme


BROKEN = [
  ("see `composer_jax/plan.py` for the planner", "no such file composer_jax/plan.py"),
  ("rules in `synth/monitor_x*`", "no such file synth/monitor_x*"),
  ("[the notes](docs/nowhere.md)", "link to a missing docs/nowhere.md"),
  ("[the table](benchmarks/RESULTS.md#no-such-section)", "no section #no-such-section"),
  ("`run.py --config.stages=pretrain,bogus`", "no stage 'bogus' (stages)"),
  ("`--config.force=all,nope`", "no stage 'nope' (force)"),
  ("`--config.train.stepz=3`", "no config key train.stepz"),
  ("`--config.model.rope.thetaa=1`", "no config key model.rope.thetaa"),
  ("set `rl.lambda_feedbak`", "rl.lambda_feedbak is neither a config key nor a library name"),
  ("run the `bogus` stage first", "no stage 'bogus'"),
  ("```bash\npython benchmarks/nope.py --x=1\n```", "no script benchmarks/nope.py"),
  ("```bash\npython run.py --wrkdir=x\n```", "run.py has no flag --wrkdir"),
  ("```bash\n.venv/bin/python benchmarks/rl_feedback.py \\\n  --sedes=0\n```", "has no flag --sedes"),
  ("`python run.py --config=experiments/composer25.py:huge_1t`", "has no variant 'huge_1t'"),
]


@pytest.mark.parametrize("line, problem", BROKEN, ids=[p for _, p in BROKEN])
def test_a_broken_line_is_caught(line, problem):
  found = problems(line, _ROOT / "README.md")
  assert any(problem in p for p in found), found


def test_what_exists_passes():
  fine = (
    "`composer_jax/data/packing.py`, `rl/envs/factories.py`, `synth/monitor*`, [docs](docs/cluster.md), "
    "`--config.rl.schedule.steps=3`, `--config.force=all`, `rl.teacher`, `rl.sampler`, `train.loop.fit`, "
    "`gate.json`, the `gate` stage, "
    "`python run.py --config=experiments/composer25.py:kimi_k25_1t --workdir=x`"
  )
  assert problems(fine, _ROOT / "README.md") == []
