"""A stand-in for Hugging Face Jobs on this machine: `run_job` runs each job as a local process.

    emulator = HfJobsEmulator(tmp_path, substitutions={install_lines: "true"})
    launcher = HfJobsLauncher(plan, run_job=emulator.run_job, cancel_job=emulator.cancel_job,
                              upload=emulator.upload, exposed_url=emulator.exposed_url, ...)

What a job gets, as on HF Jobs, except the image:

    command   run as written, in a fresh folder; only the text named in `substitutions` is
              replaced (the test swaps the wheel install for `true`: the venv has grpo_lab)
    env       the job's env and secrets, on a bare environment (PATH starts with this venv's
              bin folder, so `python3` and `grpo-lab` are this venv's) plus `host_env`, the
              settings of this machine an image would bake in (HF_HUB_OFFLINE, PYTHONPATH)
    volumes   a bucket `owner/name` is the folder `<root>/buckets/owner/name`; one host has no
              mount namespace, so a job's `mount_path` must be that folder itself (the plan takes
              its mount path as a parameter): no symlink, every job sees the bucket at the same
              absolute path, as the plan requires. The mount's rules are enforced in every Python
              process of the job (`sitecustomize`, an audit hook): a read-only mount takes no
              write, no new folder, no rename or delete; a read-write one takes files written
              whole (hf-mount's default mode: a new file, or one overwritten from the start), no
              append and no in-place edit of an existing file. Two optional rules of a slower or
              older mount: `mount_lag_s` (a file another process wrote is not found until it is
              that many seconds old, by its mtime: a job sees its own writes at once; uploads
              count as old) and `mount_renames=False` (os.rename under a read-write mount fails
              with EOPNOTSUPP)
    expose    `exposed_url(job_id, port)` is `http://127.0.0.1:<port>`: jobs share this host, so
              the plan gives them distinct ports (`RecipeConfig.free_ports`). With
              `jobs_proxy_token`, it is instead a gate standing in for the public jobs proxy:
              a request without `Authorization: Bearer <that token>` is answered 401 there, and
              one with it is forwarded without the header (whether the real proxy forwards it
              is unverified: the emulator takes the case that breaks what depends on it)

`upload` stands in for `upload_to_buckets` (files copied into the bucket's folder),
`inspect_job` for huggingface_hub's (the job's stage), `read_bucket_file` for a download of one
bucket file. Nothing leaves this machine. `close()` cancels every job still running.
"""

from __future__ import annotations

import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

from grpo_lab.util.processes import stop_groups

MOUNTS_ENV = "HF_JOBS_EMULATOR_MOUNTS"
LAG_ENV = "HF_JOBS_EMULATOR_MOUNT_LAG_S"
NO_RENAME_ENV = "HF_JOBS_EMULATOR_NO_RENAME"

SITECUSTOMIZE = textwrap.dedent('''
    """Bucket mount rules of tests/hf_jobs_emulator.py, loaded by every Python process of a job."""
    import errno
    import os
    import sys
    import time

    _MOUNTS = [tuple(item.rsplit("=", 1)) for item in
               os.environ.get("HF_JOBS_EMULATOR_MOUNTS", "").split(os.pathsep) if item]
    _LAG_S = float(os.environ.get("HF_JOBS_EMULATOR_MOUNT_LAG_S") or 0)
    _RENAMES = not os.environ.get("HF_JOBS_EMULATOR_NO_RENAME")
    _OWN = set()  # what this process wrote or renamed into place: seen at once, whatever the lag
    _CHANGES = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.chmod",
                "os.truncate", "os.utime", "os.link", "os.symlink", "os.chown"}

    def _mode_of(path):
        if isinstance(path, int) or path is None:
            return None
        path = os.path.abspath(os.fsdecode(path))
        for root, mode in _MOUNTS:
            if path == root or path.startswith(root + os.sep):
                return mode
        return None

    def _own(path):
        return any(path == p or path.startswith(p + os.sep) for p in _OWN)

    def _not_visible_yet(path):
        """A file another process wrote under a mount, younger than the lag."""
        path = os.path.abspath(os.fsdecode(path))
        try:
            return not _own(path) and os.stat(path).st_mtime > time.time() - _LAG_S
        except OSError:
            return False

    def _hook(event, args):
        if event == "open":
            path, _, flags = args
            mode = _mode_of(path)
            if mode is None or not isinstance(flags, int):
                return
            if not flags & (os.O_WRONLY | os.O_RDWR):
                if _LAG_S and _not_visible_yet(path):
                    raise FileNotFoundError(errno.ENOENT, "not in this job's mount yet "
                                            "(the emulator's mount lag)", path)
                return
            _OWN.add(os.path.abspath(os.fsdecode(path)))
            if mode == "ro":
                raise PermissionError(errno.EROFS, "read-only bucket mount", path)
            if os.path.exists(path) and not flags & os.O_TRUNC:
                raise OSError(errno.EOPNOTSUPP, "a bucket mount takes whole-file writes only "
                              "(no append, no in-place edit of an existing file)", path)
        elif event in _CHANGES:
            for path in args[:2] if event in ("os.rename", "os.link", "os.symlink") else args[:1]:
                if _mode_of(path) == "ro":
                    raise PermissionError(errno.EROFS, f"read-only bucket mount ({event})", path)
                if event == "os.rename" and not _RENAMES and _mode_of(path) == "rw":
                    raise OSError(errno.EOPNOTSUPP, "this bucket mount does not rename", path)
            if event == "os.rename" and not isinstance(args[1], int):
                _OWN.add(os.path.abspath(os.fsdecode(args[1])))

    if _MOUNTS:
        sys.addaudithook(_hook)
''')


class HfJobsEmulator:
    """`run_job`, `cancel_job` and the bucket uploads of Hugging Face Jobs, on this machine."""

    def __init__(self, root: str | Path, *, substitutions: dict[str, str] | None = None,
                 host_env: dict[str, str] | None = None, mount_lag_s: float = 0.0,
                 mount_renames: bool = True, jobs_proxy_token: str | None = None):
        self.root = Path(root)
        self.jobs_proxy_token = jobs_proxy_token
        self._gates: dict[tuple[str, int], ThreadingHTTPServer] = {}
        self.mount_lag_s, self.mount_renames = mount_lag_s, mount_renames
        self.substitutions = dict(substitutions or {})
        self.substituted: dict[str, int] = dict.fromkeys(self.substitutions, 0)
        self.host_env = dict(host_env or {})
        self.jobs: dict[str, SimpleNamespace] = {}
        self._ids = itertools.count(1)
        self.site_dir = self.root / "site"
        self.site_dir.mkdir(parents=True, exist_ok=True)
        (self.site_dir / "sitecustomize.py").write_text(SITECUSTOMIZE)

    # --- the bucket ------------------------------------------------------------------------

    def bucket_dir(self, bucket_id: str) -> Path:
        return self.root / "buckets" / bucket_id

    def upload(self, uploads, token=None, build_wheel=None) -> None:
        """`upload_to_buckets`: each (source, hf://buckets/owner/name/path) copied in."""
        from grpo_lab.launch.hf_jobs import split_bucket_path
        from grpo_lab.launch.specs import PACKAGE_WHEEL

        for source, destination in uploads:
            bucket_id, path = split_bucket_path(destination)
            target = self.bucket_dir(bucket_id) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if source == PACKAGE_WHEEL:  # the install is substituted: a named placeholder
                target.write_bytes(b"grpo_lab wheel placeholder (tests/hf_jobs_emulator.py)")
            else:
                shutil.copyfile(source, target)
            if self.mount_lag_s:  # put there before any job started: visible to every job
                old = time.time() - self.mount_lag_s - 1
                os.utime(target, (old, old))

    def read_bucket_file(self, uri: str) -> bytes | None:
        """A download of `hf://buckets/owner/name/path` (None if absent): as the Hub's API sees
        the bucket, with no mount in between."""
        from grpo_lab.launch.hf_jobs import split_bucket_path

        bucket_id, path = split_bucket_path(uri)
        target = self.bucket_dir(bucket_id) / path
        return target.read_bytes() if target.is_file() else None

    # --- jobs ------------------------------------------------------------------------------

    def run_job(self, *, image, command, env=None, secrets=None, flavor=None, timeout=None,
                attempts=None, name=None, labels=None, volumes=None, expose=None,
                expose_public=None, ssh=False, network_group=None, network_aliases=None,
                resource_group_id=None, namespace=None, token=None):
        """huggingface_hub's `run_job`, same keywords (tests check the signature): starts the
        job's command as a process of this machine and returns a JobInfo-like record."""
        # The Hub's rule for what is stored as a tag: a job's name and its labels are letters,
        # digits, `-` and `_` (huggingface_hub's `_sanitize_job_name` documents it).
        for what, text in ([("name", name)] if name is not None else []) + [
                (f"label {key!r}", f"{key}{value}") for key, value in (labels or {}).items()]:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", text or "-"):
                raise ValueError(f"the Hub refuses job {what} {text!r}: letters, digits, - and _ "
                                 "only")
        job_id = f"{next(self._ids):024x}"
        job_dir = self.root / "jobs" / f"{name or 'job'}-{job_id[-4:]}"
        (job_dir / "home").mkdir(parents=True)
        mounts = []
        for volume in volumes or []:
            if volume.type != "bucket":
                raise ValueError(f"the emulator mounts buckets only, got {volume.type}")
            folder = self.bucket_dir(volume.source) / (volume.path or "")
            if Path(volume.mount_path) != folder:
                raise ValueError(f"one host has no mount namespace: mount {volume.source} at its "
                                 f"folder {folder} (RecipeConfig.mount_path), "
                                 f"not {volume.mount_path}")
            folder.mkdir(parents=True, exist_ok=True)
            mounts.append(f"{folder}={'ro' if volume.read_only else 'rw'}")
        argv = [self._substitute(arg) for arg in command]
        paths = (str(self.site_dir), self.host_env.get("PYTHONPATH"))
        python_path = os.pathsep.join(p for p in paths if p)
        job_env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                   "HOME": str(job_dir / "home"), **self.host_env, "PYTHONPATH": python_path,
                   MOUNTS_ENV: os.pathsep.join(mounts), **(env or {}), **(secrets or {})}
        if self.mount_lag_s:
            job_env[LAG_ENV] = str(self.mount_lag_s)
        if not self.mount_renames:
            job_env[NO_RENAME_ENV] = "1"
        log = (job_dir / "log.txt").open("wb")
        process = subprocess.Popen(argv, cwd=job_dir, env=job_env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        info = SimpleNamespace(id=job_id, name=name, flavor=flavor, image=image, expose=expose,
                               url=f"emulated://jobs/{job_id}", process=process,
                               log_path=job_dir / "log.txt",
                               status=SimpleNamespace(stage="RUNNING", expose_urls=None))
        self.jobs[job_id] = info
        return info

    def _substitute(self, arg: str) -> str:
        for old, new in self.substitutions.items():
            if old in arg:
                self.substituted[old] += 1
                arg = arg.replace(old, new)
        return arg

    def exposed_url(self, job_id: str, port: int) -> str:
        if self.jobs_proxy_token is None:
            return f"http://127.0.0.1:{port}"
        if (job_id, port) not in self._gates:
            gate = ThreadingHTTPServer(("127.0.0.1", 0), _gate_handler(port,
                                                                     self.jobs_proxy_token))
            threading.Thread(target=gate.serve_forever, daemon=True).start()
            self._gates[(job_id, port)] = gate
        return f"http://127.0.0.1:{self._gates[(job_id, port)].server_address[1]}"

    def cancel_job(self, *, job_id, namespace=None, token=None) -> None:
        info = self.jobs[job_id]
        if info.process.poll() is None:
            info.status.stage = "CANCELED"
        # also what its main process left behind, as a container ends
        stop_groups([info.process], grace_s=10.0)

    def inspect_job(self, *, job_id, namespace=None, token=None) -> SimpleNamespace:
        """huggingface_hub's `inspect_job`: the job's record, its stage brought up to date."""
        info = self.jobs[job_id]
        code = info.process.poll()
        if code is not None and info.status.stage == "RUNNING":
            info.status.stage = "COMPLETED" if code == 0 else "ERROR"
        return info

    def wait(self, job_id: str, timeout_s: float) -> int:
        """The job's exit code; raises TimeoutError with its log tail if it runs past timeout_s."""
        info = self.jobs[job_id]
        try:
            code = info.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{info.name} still running after {timeout_s} s:\n"
                               f"{self.logs(job_id)[-3000:]}") from None
        if info.status.stage == "RUNNING":
            info.status.stage = "COMPLETED" if code == 0 else "ERROR"
        # A job ends with its main process, and its container with it: the trainer job's
        # background proxy must not outlive it.
        stop_groups([info.process], grace_s=10.0)
        return code

    def running(self, job_id: str) -> bool:
        return self.jobs[job_id].process.poll() is None

    def logs(self, job_id: str) -> str:
        return self.jobs[job_id].log_path.read_text(errors="replace")

    def close(self) -> None:
        for job_id in self.jobs:
            self.cancel_job(job_id=job_id)
        for gate in self._gates.values():
            gate.shutdown()
            gate.server_close()
        self._gates.clear()

    def __enter__(self) -> HfJobsEmulator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _gate_handler(port: int, token: str):
    """The public jobs proxy in front of a job's exposed `port`: the HF token or 401; forwarded
    without the Authorization header; 502 while nothing listens behind it."""

    class Gate(BaseHTTPRequestHandler):
        def _forward(self):
            if self.headers.get("Authorization") != f"Bearer {token}":
                return self._answer(401, {"Content-Type": "application/json"},
                                    b'{"error": "Invalid credentials"}')
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("authorization", "host", "content-length")}
            request = urllib.request.Request(f"http://127.0.0.1:{port}{self.path}", data=body,
                                             headers=headers, method=self.command)
            try:
                with urllib.request.urlopen(request, timeout=1000) as response:
                    return self._answer(response.status, response.headers, response.read())
            except urllib.error.HTTPError as exc:
                return self._answer(exc.code, exc.headers, exc.read())
            except OSError as exc:
                return self._answer(502, {"Content-Type": "text/plain"}, str(exc).encode())

        do_GET = do_POST = do_PUT = do_DELETE = _forward

        def _answer(self, status: int, headers, data: bytes) -> None:
            self.send_response(status)
            for key, value in headers.items():
                if key.lower() not in ("content-length", "transfer-encoding", "connection",
                                       "date", "server"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    return Gate


def run_job_keywords() -> list[str]:
    """The keywords of the emulator's `run_job` (to compare with huggingface_hub's)."""
    return list(inspect.signature(HfJobsEmulator.run_job).parameters)[1:]
