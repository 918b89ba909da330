"""A small seccomp filter for the sandbox: no new namespaces (user namespaces above all), no tracing, no
host-wide state.

Why: as root the sandbox runs without a user namespace (see sandbox.py), so nothing stops the code inside
from calling `unshare(CLONE_NEWUSER)` and gaining a full capability set in a namespace of its own, from
which mount and network namespaces follow. bubblewrap's `--disable-userns` needs `--unshare-user`, which
the root path does not use; a seccomp filter works on both paths. The filter is classic BPF, written
here by hand (no libseccomp in the venv): it is loaded by bwrap (`--add-seccomp-fd`) just before the
sandboxed command is executed, so bwrap's own set-up is not affected.

Denied with EPERM: unshare, setns, clone with any namespace flag, ptrace, process_vm_readv/writev, bpf,
userfaultfd, perf_event_open, the keyring calls and every mount call. Also every call that reads state one
sandbox can move and a later one can read (runs of a grade must not talk to each other, nor learn
when they run): sysinfo (uptime, load averages, free memory, process count: the /proc files with
the same counters are masked in bwrap.py), syslog (the kernel log, where a crash of one run is a line
another can read), and the page cache's residency of the read-only files every sandbox shares (cachestat,
mincore, io_uring, and preadv2 with RWF_NOWAIT). The static host identity stays (uname's release; the
hostname is fixed by bwrap.py). clone3 gets ENOSYS (its flags sit in
a struct the filter cannot read; glibc then falls back to clone, which the filter can check). Calls from
another architecture's ABI (i386 on x86_64, x32) are denied outright. Unknown machine architectures get
no filter: `supported()` says so and the sandbox states it.
"""

import errno
import platform
import struct

# linux/filter.h, linux/seccomp.h, linux/audit.h
_LD_W_ABS, _JEQ, _JSET, _JGE, _RET = 0x20, 0x15, 0x45, 0x35, 0x06
_ALLOW = 0x7FFF0000
_ERRNO = 0x00050000
_X32_BIT = 0x40000000
_NS_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
_RWF_NOWAIT = 0x8
_DENIED = (
  "unshare setns ptrace process_vm_readv process_vm_writev bpf userfaultfd perf_event_open keyctl add_key "
  "request_key mount umount2 pivot_root open_tree move_mount fsopen fsmount mount_setattr "
  "sysinfo syslog cachestat mincore io_uring_setup io_uring_enter io_uring_register"
).split()
_AUDIT = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# name: (x86_64 number, aarch64 number)
_NR = {
  "unshare": (272, 97), "setns": (308, 268), "clone": (56, 220), "clone3": (435, 435), "ptrace": (101, 117),
  "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "bpf": (321, 280),
  "userfaultfd": (323, 282),
  "perf_event_open": (298, 241), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
  "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "open_tree": (428, 428),
  "move_mount": (429, 429), "fsopen": (430, 430), "fsmount": (432, 432), "mount_setattr": (442, 442),
  "sysinfo": (99, 179), "syslog": (103, 116), "cachestat": (451, 451), "mincore": (27, 232),
  "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
  "preadv2": (327, 286),
}  # fmt: skip


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
  return struct.pack("=HBBI", code, jt, jf, k)


def machine() -> str:
  m = platform.machine().lower()
  return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def supported(arch: str | None = None) -> bool:
  return (arch or machine()) in _AUDIT


def program(arch: str | None = None) -> bytes:
  """The filter as `struct sock_filter[]` bytes for `arch` (default: this machine's); ValueError if none."""
  arch = arch or machine()
  if arch not in _AUDIT:
    raise ValueError(f"no seccomp filter for architecture {arch!r}")
  audit, col = _AUDIT[arch], list(_AUDIT).index(arch)
  nr = {name: nums[col] for name, nums in _NR.items()}
  eperm, enosys = _ERRNO | errno.EPERM, _ERRNO | errno.ENOSYS
  out = [_insn(_LD_W_ABS, 4), _insn(_JEQ, audit, 1, 0), _insn(_RET, eperm), _insn(_LD_W_ABS, 0)]
  if arch == "x86_64":
    out += [_insn(_JGE, _X32_BIT, 0, 1), _insn(_RET, eperm)]
  for name in _DENIED:
    out += [_insn(_JEQ, nr[name], 0, 1), _insn(_RET, eperm)]
  out += [_insn(_JEQ, nr["clone3"], 0, 1), _insn(_RET, enosys)]
  # preadv2: RWF_NOWAIT (flags, the sixth argument, low word at offset 56) tells a cached page from one on
  # disk; without it the call is allowed here (it is no other call).
  out += [_insn(_JEQ, nr["preadv2"], 0, 4), _insn(_LD_W_ABS, 56), _insn(_JSET, _RWF_NOWAIT, 0, 1)]
  out += [_insn(_RET, eperm), _insn(_RET, _ALLOW)]
  # clone: the flags are the first argument; its low 32 bits sit at offset 16 (little-endian).
  out += [_insn(_JEQ, nr["clone"], 0, 3), _insn(_LD_W_ABS, 16), _insn(_JSET, _NS_FLAGS, 0, 1)]
  out += [_insn(_RET, eperm), _insn(_RET, _ALLOW)]
  return b"".join(out)
