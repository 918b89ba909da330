"""`python tests/full_disk_run.py <run.py's flags>`: run.py, but the checkpoint disk fills up at a set
moment (tests/test_robustness.py runs it on a small tmpfs; nothing here is used by the library).

With FULL_DISK_AT=n in the environment, the save of step n (the final save of an n-step run) first fills
the checkpoint directory's file system with a file `disk_filler` that leaves FULL_DISK_RESERVE_KIB
(default 64) free: room for the last few KB of a save in flight, never for a whole checkpoint. With
HOLD_SAVE=k, the save of step k is held just before it commits (its data written, its checksums and the
rename to `<k>` not yet) and the save of step n fills the disk once step k's is held, then lets it go:
the save of step n starts while the one of step k is still in flight, on every run.
"""

import os
import pathlib
import runpy
import sys
import threading

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _fill(directory: pathlib.Path, reserve: int) -> None:
  st = os.statvfs(directory)
  with open(directory / "disk_filler", "wb") as f:
    f.write(bytes(max(st.f_bavail * st.f_frsize - reserve, 0)))


def _patch(fill_at: int, reserve: int, hold: int | None) -> None:
  from composer_jax.train import checkpoint

  held, full = threading.Event(), threading.Event()
  save, checksum = checkpoint.Checkpointer.save, checkpoint.Checkpointer._checksum_new_steps

  def filling_save(self, state, data_state, *, force=False):
    if int(state.step) == fill_at and not full.is_set():
      if hold is not None:
        assert held.wait(timeout=300), f"the save of step {hold} never reached its commit"
      _fill(self.directory, reserve)
      full.set()
    return save(self, state, data_state, force=force)

  def held_checksum(self):  # orbax's post-finalization callback: in the background, before the rename
    holding = hold is not None and any(self.directory.glob(f"{hold}{checkpoint._TMP_MARK}*"))
    if holding and threading.current_thread() is not threading.main_thread():
      held.set()
      assert full.wait(timeout=300), f"the save of step {fill_at} never started"
    return checksum(self)

  checkpoint.Checkpointer.save = filling_save
  checkpoint.Checkpointer._checksum_new_steps = held_checksum


if __name__ == "__main__":
  sys.path[0] = str(_ROOT)  # as for `python run.py`: this checkout's composer_jax, not tests/'s modules
  hold = os.environ.get("HOLD_SAVE")
  reserve = int(os.environ.get("FULL_DISK_RESERVE_KIB", "64")) * 1024
  _patch(int(os.environ["FULL_DISK_AT"]), reserve, None if hold is None else int(hold))
  sys.argv = [str(_ROOT / "run.py"), *sys.argv[1:]]
  runpy.run_path(str(_ROOT / "run.py"), run_name="__main__")
