"""The optimized HLO module's text (`compiled.as_text()`) as computations of instructions: name, result
shape, opcode, operands and attributes, enough for `plan.estimate` to weight loop bodies and cost ops.
Instruction names are unique within a module, so one table maps every name to its instruction.
"""

from __future__ import annotations

import dataclasses
import math
import re

BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
BYTES |= {"f64": 8, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b(" + "|".join(BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass
class Instr:
  name: str
  shape: str  # the result shape text
  opcode: str
  operands: list[str]
  args: str  # the text inside the operand parentheses (a constant's value)
  attrs: str  # everything after the operand list
  root: bool = False


def _closing(text: str, depth: int) -> int:
  """Index of the parenthesis that brings `depth` open ones to zero (len(text) if none)."""
  for i, ch in enumerate(text):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return i
  return len(text)


def _split_instruction(line: str) -> Instr | None:
  """One HLO instruction line → (name, result shape, opcode, operand names, attributes)."""
  found = _NAME.match(line)
  if not found:
    return None
  root = line.lstrip().startswith("ROOT ")
  rest = line[found.end() :]
  if rest.startswith("("):  # a tuple shape: up to its matching parenthesis
    end = _closing(rest, 0)
    shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  opcode, _, rest = rest.partition("(")
  end = _closing(rest, 1)
  args = rest[:end]
  return Instr(found.group(1), shape, opcode.strip(), _OPERAND.findall(args), args, rest[end + 1 :], root)


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instr]], str]:
  """{computation name: its instructions} of an HLO module's text, and the entry computation's name."""
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header and "=" not in line.split("(")[0]:
      current = comps.setdefault(header.group(1), [])
      entry = header.group(1) if line.startswith("ENTRY") else entry
    elif line.strip() == "}":
      current = None
    elif current is not None and (instr := _split_instruction(line)):
      current.append(instr)
  return comps, entry


def dims(shape: str) -> list[tuple[int, list[int]]]:
  """(bytes per element, dims) of each array in a shape text (a tuple gives several)."""
  return [(BYTES[t], [int(d) for d in dims.split(",") if d]) for t, dims in _ARRAY.findall(shape)]


def shape_bytes(shape: str) -> int:
  return sum(b * math.prod(d) for b, d in dims(shape))


def shape_of(table: dict[str, Instr], name: str) -> str:
  return table[name].shape if name in table else ""


def int_set(attrs: str, key: str) -> list[int]:
  found = re.search(key + r"=\{([\d,]*)\}", attrs)
  return [int(x) for x in found.group(1).split(",") if x] if found else []
