"""One run per output_dir: the main process holds the folder while a run uses it.

Why: two `train.py` launches into one output_dir both run to the end (exit 0 and 0), writing the same checkpoint
names and the same final adapter over each other; a second launch with `--overwrite_output_dir` would even move the
live run's checkpoints aside. So a launch takes a hold on the folder -- the file `output_dir/_run_hold.json`, naming
its host, process id and start time -- before anything in the folder is moved and before any weight loads, and a
second launch is refused (ConfigError: exit 2) while the holder lives.

How, on the shared filesystems multi-node runs use (NFS, Lustre, GPFS): the MAIN process (global rank 0) creates the
hold atomically -- a temporary file written whole, then `os.link` to the hold's name, which fails when the name exists
and is atomic on NFS (O_CREAT|O_EXCL where the filesystem has no hard links) -- and broadcasts the outcome over the
process group, so every rank goes on, or exits 2, together. fcntl/flock locks are not used: on NFS they depend on a
lock daemon (some mounts have none), and a lock cannot say who holds it, which the refusal names.

When the holder is gone (the hold is "stale") the next launch takes it over with one warning line saying why:
- same host (hostname and boot id): its process id is not running, is a zombie, or is another process now (a pid is
  reused: the start time differs). This needs no clock and no heartbeat.
- another host, "according to the launcher": the same Slurm job (SLURM_JOB_ID) with another SLURM_RESTART_COUNT
  means the job was requeued, and Slurm never runs two instances of one job.
- another host otherwise: the holder refreshes the hold file's modification time every HEARTBEAT_INTERVAL_S seconds
  (a daemon thread); it is stale after STALE_AFTER_S seconds without one. The age is measured against the mtime of a
  file the checker has just written beside it, so both times come from the filesystem's clock, not two hosts' clocks.
A preempted run (exit 75) has released its hold, so its resume is never blocked; after a crash (SIGKILL, OOM kill:
the hold file stays behind) the resume takes it over at once on the same host or after Slurm's requeue, and from
another host after STALE_AFTER_S.

Released (the file removed, if it is still this run's) when the run ends in any way train.py controls: success,
a refusal after the hold, preemption (exit 75), an exception, KeyboardInterrupt.

Not guarded: launches of other tools into the folder (they take no hold); two containers sharing a hostname and a
kernel but not a pid namespace (same host by name, the pid checked in the wrong namespace); a holder suspended
(SIGSTOP, a frozen VM) for longer than STALE_AFTER_S on another host is taken as gone; takeover races of three or
more launches within the same few milliseconds (two racing launches are safe: one wins, the other is refused);
a hold file deleted by hand while the run lives.
"""

from __future__ import annotations

import datetime
import errno
import json
import logging
import os
import socket
import threading
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Not a result: previous_results/move_previous_run_aside never count or move it, and the leading "_" keeps it out of
# transformers' push_to_hub uploads (ignore_patterns "_*"): it names hosts and process ids.
HOLD_FILE = "_run_hold.json"
HEARTBEAT_INTERVAL_S = 60  # how often the holder touches the hold file
STALE_AFTER_S = 10 * 60  # a hold on another host untouched this long is taken over (10 heartbeats missed)
START_TIME_TOLERANCE_S = 1.0  # psutil's start times of one process agree to the tick; a reused pid starts later
_TAKEOVER_ATTEMPTS = 3  # a racing launch may create the hold between our removal of a stale one and our create
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


@dataclass(frozen=True)
class Holder:
    """Who holds (or asks for) the folder: what the hold file records."""

    host: str
    pid: int
    start_time_s: float  # the process's start, seconds since the epoch (psutil's create_time)
    boot_id: str = ""  # Linux's per-boot id: the same host name with another boot id means the host restarted
    slurm_job_id: str = ""
    slurm_restart_count: str = ""
    token: str = ""  # tells this run's hold from a later one at the same name

    def describe(self) -> str:
        return f"host {self.host}, process {self.pid}, started {_when(self.start_time_s)}"


def this_process(environ: dict | None = None) -> Holder:
    """This process as a holder; `environ`: the Slurm variables (SLURM_JOB_ID, SLURM_RESTART_COUNT) as LaunchEnv
    read them (none when not given)."""
    import psutil

    env = environ or {}
    job = env.get("SLURM_JOB_ID", "")
    return Holder(host=socket.gethostname(), pid=os.getpid(), start_time_s=psutil.Process().create_time(),
                  boot_id=_boot_id(), slurm_job_id=job,
                  slurm_restart_count=env.get("SLURM_RESTART_COUNT", "0") if job else "", token=uuid.uuid4().hex)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the same host name is taken as the same boot
        return ""


def _when(epoch_s: float) -> str:
    return datetime.datetime.fromtimestamp(epoch_s).astimezone().isoformat(timespec="seconds")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} minutes" if seconds >= 60 else f"{seconds:.0f} s"


def gone_because(holder: Holder | None, heartbeat_age_s: float, me: Holder,
                 stale_after_s: float = STALE_AFTER_S) -> str | None:
    """Why the holder's run is over (the reason a takeover logs), or None when it may still be running.
    `holder` None: the hold file does not parse (written by hand?): only its age can tell."""
    import psutil

    if holder is None:
        return f"its hold file does not parse and was last touched {_minutes(heartbeat_age_s)} ago" \
            if heartbeat_age_s > stale_after_s else None
    if holder.host == me.host:
        if holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
            return f"host {holder.host} has restarted since (another boot id)"
        try:
            process = psutil.Process(holder.pid)
            started_s, zombie = process.create_time(), process.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return f"process {holder.pid} is no longer running on {holder.host}"
        except psutil.Error:  # not ours to inspect (another user's): it exists, so take it as the holder
            return None
        if abs(started_s - holder.start_time_s) > START_TIME_TOLERANCE_S:
            return f"process id {holder.pid} belongs to another process now (started {_when(started_s)})"
        return f"process {holder.pid} has exited (a zombie not yet reaped)" if zombie else None
    if holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id and \
            holder.slurm_restart_count != me.slurm_restart_count:
        return (f"Slurm job {holder.slurm_job_id} has been requeued since (restart {holder.slurm_restart_count} -> "
                f"{me.slurm_restart_count}), so its earlier run is over")
    if heartbeat_age_s > stale_after_s:
        return (f"its heartbeat is {_minutes(heartbeat_age_s)} old (a live run refreshes it every "
                f"{HEARTBEAT_INTERVAL_S} s; stale after {_minutes(stale_after_s)})")
    return None


class RunHold:
    """A hold this process has taken: refreshed by a heartbeat thread until `release()`."""

    def __init__(self, path: Path, holder: Holder, taken_over: str | None = None, created_folder: bool = False):
        self.path, self.holder, self.taken_over = path, holder, taken_over  # taken_over: the line logged, if any
        self.created_folder = created_folder  # output_dir did not exist before this hold: removed again if empty
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start_heartbeat(self, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self._thread = threading.Thread(target=self._beat, args=(interval_s,), name="run-hold-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                if not self._still_ours():
                    logger.warning(f"--output_dir {self.path.parent}: this run's hold ({self.path}) was removed or "
                                   "taken over by another launch; another run may now write into this folder.")
                    return
                os.utime(self.path)  # no times given: NFS sets the server's time
            except OSError as e:  # a filesystem hiccup: the next beat tries again
                logger.warning(f"could not refresh the run hold {self.path}: {e}")

    def _still_ours(self) -> bool:
        holder, _ = _read(self.path)
        return holder is not None and holder.token == self.holder.token

    def release(self) -> None:
        """Stop the heartbeat and remove the hold if it is still this run's (never another run's)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._still_ours():
            self.path.unlink(missing_ok=True)
        if self.created_folder:  # a refused launch leaves no empty output_dir behind (exit 2 changes nothing)
            try:
                self.path.parent.rmdir()
            except OSError:  # not empty (the run wrote something) or gone: nothing to undo
                pass


def _read(path: Path) -> tuple[Holder | None, bytes | None]:
    """(holder or None when the file does not parse, the raw bytes or None when there is no file)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    try:
        fields = json.loads(raw)
        holder = Holder(**{k: fields[k] for k in Holder.__dataclass_fields__ if k in fields})
    except (ValueError, TypeError):
        return None, raw
    typed = isinstance(holder.host, str) and isinstance(holder.pid, int) and \
        isinstance(holder.start_time_s, int | float)
    return (holder if typed else None), raw


def _create(tmp: Path, path: Path, content: bytes) -> bool:
    """Create `path` with `content` unless it exists (True: created), atomically."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        # NFS: a retried LINK whose first reply was lost answers EEXIST although it worked; the count tells.
        return os.stat(tmp).st_nlink == 2
    except OSError as e:
        if e.errno not in _NO_HARD_LINKS:
            raise
    try:  # a filesystem without hard links (some FUSE and SMB mounts)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(content)
    return True


def _remove_if_unchanged(path: Path, raw: bytes, token: str) -> bool:
    """Remove the stale hold `path` if it still holds `raw` (True). Renamed first, to a name only this launch uses,
    so that a racing launch's fresh hold created meanwhile is put back, not deleted."""
    aside = path.with_name(f"{HOLD_FILE}.stale-{token}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:  # another launch removed it first
        return False
    try:
        if aside.read_bytes() == raw:
            return True
        try:
            os.link(aside, path)  # someone else's hold: put it back
        except FileExistsError:
            pass
        return False
    finally:
        aside.unlink(missing_ok=True)


def acquire(output_dir: str | os.PathLike, environ: dict | None = None, stale_after_s: float = STALE_AFTER_S,
            heartbeat_interval_s: float | None = HEARTBEAT_INTERVAL_S) -> RunHold:
    """Take the hold on `output_dir` for this process (the folder is created if needed) and start its heartbeat
    (None: no heartbeat). Raises ConfigError while another live run holds it; a stale hold is taken over."""
    from sft_recipe.errors import ConfigError

    root = Path(output_dir)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    path = root / HOLD_FILE
    me = this_process(environ)
    content = json.dumps({**asdict(me), "started": _when(me.start_time_s), "output_dir": str(root.resolve()),
                          "heartbeat_interval_s": heartbeat_interval_s, "stale_after_s": stale_after_s}).encode()
    tmp = root / f"{HOLD_FILE}.{me.token}.tmp"
    with open(tmp, "wb") as f:  # written whole before it gets the hold's name
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    taken_over = None
    try:
        for _ in range(_TAKEOVER_ATTEMPTS):
            if _create(tmp, path, content):
                hold = RunHold(path, me, taken_over, created_folder=created)
                if taken_over:
                    logger.warning(taken_over)
                if heartbeat_interval_s:
                    hold.start_heartbeat(heartbeat_interval_s)
                return hold
            holder, raw = _read(path)
            if raw is None:  # released meanwhile
                continue
            age_s = _heartbeat_age_s(tmp, path)
            why = gone_because(holder, age_s, me, stale_after_s)
            if why is None:
                raise ConfigError([_refusal(root, path, holder, age_s, me, stale_after_s)])
            if _remove_if_unchanged(path, raw, me.token):
                who = holder.describe() if holder else "an unreadable hold"
                taken_over = f"--output_dir {root}: taking over the hold of a run that is gone ({who}): {why}."
        raise ConfigError([f"--output_dir {root}: other launches kept taking {path} while this one tried "
                           f"({_TAKEOVER_ATTEMPTS} attempts). Fix: start one run per output_dir at a time."])
    finally:
        tmp.unlink(missing_ok=True)


def _heartbeat_age_s(tmp: Path, path: Path) -> float:
    """Seconds since the hold was last touched, both times from the filesystem's clock: `tmp` is touched now."""
    os.utime(tmp)
    try:
        return max(0.0, os.stat(tmp).st_mtime - os.stat(path).st_mtime)
    except FileNotFoundError:  # released meanwhile: the next attempt creates it
        return 0.0


def _refusal(root: Path, path: Path, holder: Holder | None, age_s: float, me: Holder, stale_after_s: float) -> str:
    if holder is None:
        who, why = f"an unreadable hold file {path}", f"touched {_minutes(age_s)} ago"
    elif holder.host == me.host:
        who, why = holder.describe(), f"process {holder.pid} is running on this host"
    else:
        who, why = holder.describe(), (f"its heartbeat is {_minutes(age_s)} old; a run on another host is taken as "
                                       f"gone after {_minutes(stale_after_s)} without one")
    return (f"--output_dir {root}: another run is using this folder ({who}; {why}; hold file {path}). Two runs in "
            "one folder write the same checkpoints and final adapter over each other. Fix: wait until that run "
            "ends, or give this launch another --output_dir. (Had it crashed, its hold would have been taken over: "
            f"at once on its own host, from another host once its heartbeat is {_minutes(stale_after_s)} old.)")


_active: RunHold | None = None  # the hold this process took (main process only), released by release_run_hold


def take_run_hold(output_dir: str | os.PathLike, launch) -> RunHold | None:
    """train.py's hook, on EVERY rank: the main process takes the hold, then every rank learns the outcome, so all
    go on or all raise ConfigError (exit 2) together -- no rank goes on to load the model alone."""
    import torch.distributed as dist

    from sft_recipe.errors import ConfigError

    global _active
    outcome: tuple[str, list[str]] = ("held", [])
    error: BaseException | None = None
    if launch.is_main_process:
        try:
            _active = acquire(output_dir, {"SLURM_JOB_ID": launch.slurm_job_id,
                                           "SLURM_RESTART_COUNT": launch.slurm_restart_count})
        except ConfigError as e:
            outcome = ("refused", e.problems)
        except OSError as e:
            outcome = ("refused", [f"--output_dir {output_dir}: could not create the run hold there ({e}). Fix: a "
                                   "folder this user can write, on a filesystem every rank's host shares."])
        except Exception as e:  # noqa: BLE001 -- the others wait in the broadcast below: tell them, then re-raise
            outcome, error = ("failed", [f"{type(e).__name__}: {e}"]), e
    if launch.world_size > 1:
        # TrainingArguments (parse_args) sets up accelerate's PartialState, which creates the process group, so it
        # exists here. Without one no rank can learn rank 0's outcome: every rank stops alike rather than guess.
        if not (dist.is_available() and dist.is_initialized()):
            release_run_hold()
            raise RuntimeError("take_run_hold: WORLD_SIZE > 1 but torch.distributed is not initialised, so the ranks "
                               "cannot agree on the output_dir hold; it must be called after TrainingArguments.")
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    kind, problems = outcome
    if kind == "refused":
        raise ConfigError(problems)
    if kind == "failed":
        raise RuntimeError(f"the main process failed while taking the output_dir hold: {problems[0]}")
    return _active


def release_run_hold() -> None:
    """Release this process's hold, if it took one (train.py calls it however the run ends; a no-op elsewhere)."""
    global _active
    hold, _active = _active, None
    if hold is not None:
        try:
            hold.release()
        except OSError as e:  # never turn a run's ending into another error: the next launch finds it stale
            logger.warning(f"could not release the run hold {hold.path}: {e}")
