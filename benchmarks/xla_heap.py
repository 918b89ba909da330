"""Where XLA:TPU's temporaries go, from the dump of a compiled step: the heap its buffer assignment lays
out, the largest set of temporaries live at one point of the schedule, and what `memory_analysis()`
counts beyond that heap. The planner predicts live sets (plan/memory.py, plan/rollout.py); this is how
its heap and outside-heap constants were read.

  XLA_FLAGS="--xla_dump_to=<dir> --xla_dump_hlo_module_re=.*jit_step.*" \\
    python run.py --config=experiments/composer25.py:<variant> --config.stages=compile \\
    --config.compile.topology=<topology> --config.compile.step=<train|rl> --workdir=<wd>
  python benchmarks/xla_heap.py --dump=<dir> --compile_json=<wd>/compile.json [--top=12] [--out=<json>]

Reads `*jit_step*after_optimizations-buffer-assignment.txt` (allocations and the values in them) and
`...-live-range.txt` (each value's first and last position in the flattened schedule). Values placed in
a donated parameter's allocation are not temporaries and are left out, as XLA's temp size does.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

GIB = 2**30
_ALLOCATION = re.compile(r"allocation (\d+): size (\d+), (.*)")
_VALUE = re.compile(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")
_RANGE = re.compile(r"\s+(\S+?)(\{[^}]*\})?:(\d+)-(\d+)$")


def _kind(description: str) -> str:
  if "preallocated-temp" in description:
    return "other_memory_space" if "color" in description else "heap"
  return "parameter" if "parameter" in description else "other"


def read_buffers(text: str) -> tuple[dict[str, int], dict[str, tuple[int, str]]]:
  """(bytes per allocation kind, {value name: (bytes, shape)} for the values in the heap)."""
  kinds: dict[str, int] = {}
  heap_values: dict[str, tuple[int, str]] = {}
  kind = None
  for line in text.splitlines():
    if m := _ALLOCATION.match(line):
      kind = _kind(m.group(3))
      kinds[kind] = kinds.get(kind, 0) + int(m.group(2))
    elif (m := _VALUE.match(line)) and kind == "heap":
      name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
      size = max(int(m.group(2)), heap_values.get(name, (0, ""))[0])
      heap_values[name] = (size, m.group(3).split("{")[0])
  return kinds, heap_values


def read_ranges(text: str) -> list[tuple[str, int, int]]:
  """(value name, first, last) of every value with a live range."""
  out, inside = [], False
  for line in text.splitlines():
    if line.strip() == "BufferLiveRange:":
      inside = True
    elif inside and line.startswith("  Live ranges"):
      break
    elif inside and (m := _RANGE.match(line)):
      out.append((m.group(1) + (m.group(2) or "{}"), int(m.group(3)), int(m.group(4))))
  return out


def live_peak(values: dict[str, tuple[int, str]], ranges: list[tuple[str, int, int]], top: int) -> dict:
  """The schedule position where the most heap bytes are live, the bytes, and the largest values there."""
  spans = [(name, values[name][0], first, last) for name, first, last in ranges if name in values]
  end = max((last for *_, last in spans), default=0) + 2
  delta = [0] * end
  for _, size, first, last in spans:
    delta[first] += size
    delta[last + 1] -= size
  live, best, at = 0, 0, 0
  for i, d in enumerate(delta):
    live += d
    if live > best:
      best, at = live, i
  there = sorted((s for s in spans if s[2] <= at <= s[3]), key=lambda s: -s[1])[:top]
  return {
    "position": at,
    "bytes": best,
    "largest": [{"value": n, "shape": values[n][1], "gib": round(s / GIB, 3)} for n, s, *_ in there],
  }


def analyse(dump: pathlib.Path, compile_json: pathlib.Path | None, top: int) -> dict:
  (assignment,) = dump.glob("*jit_step*after_optimizations-buffer-assignment.txt")
  ranges_file = assignment.with_name(assignment.name.replace("buffer-assignment", "live-range"))
  kinds, values = read_buffers(assignment.read_text())
  peak = live_peak(values, read_ranges(ranges_file.read_text()), top)
  out = {
    "heap_gib": kinds.get("heap", 0) / GIB,
    "live_peak_gib": peak["bytes"] / GIB,
    "heap_over_live": kinds.get("heap", 0) / max(peak["bytes"], 1),
    "live_peak": peak,
  }
  if compile_json is not None:
    result = json.loads(compile_json.read_text())
    temp = result["memory"]["temp"]
    out |= {"variant": result["variant"], "step": result["step"], "topology": result["topology"]}
    out |= {"memory_analysis_temp_gib": temp / GIB, "outside_heap_gib": (temp - kinds.get("heap", 0)) / GIB}
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--dump", required=True, type=pathlib.Path)
  parser.add_argument("--compile_json", type=pathlib.Path)
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--out", type=pathlib.Path, help="append the result to this JSON list")
  args = parser.parse_args()
  result = analyse(args.dump, args.compile_json, args.top)
  print(json.dumps(result, indent=1))
  if args.out:
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(rows + [result], indent=1) + "\n")


if __name__ == "__main__":
  main()
