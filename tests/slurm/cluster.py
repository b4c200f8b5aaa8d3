"""A throw-away single-node Slurm on localhost: munged, mariadbd, slurmdbd, slurmctld, slurmd.

    python tests/slurm/cluster.py up STATE_DIR      # start; prints `export SLURM_CONF=...`
    python tests/slurm/cluster.py down STATE_DIR    # cancel its jobs, stop exactly the daemons it started

Everything (configs, munge key, database, spool, logs, pids.json) lives under STATE_DIR; ports are
free ports picked at start, so it never touches a system Slurm. Daemons run in the foreground (-D)
as children started here, so their pids are known and `down` stops those pids and nothing else.
slurmdbd is needed: without accounting, sacct is unavailable and submitit cannot tell a killed job
from a running one. `AuthInfo=cred_expire=5`: Slurm holds a requeued job until the old job's
credential expires (120 s by default).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd")
APT_PACKAGES = ("slurm-wlm", "munge", "slurmdbd", "mariadb-server")
BINARIES = ("munged", "mariadbd", "mariadb-install-db", "slurmdbd", "slurmctld", "slurmd", "sbatch", "sacct")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def allowed_to_install() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get("LOWP_TEST_SLURM") == "1"


def ensure_installed() -> None:
    """apt-get the Debian packages if a binary is missing (only called where installing is allowed)."""
    if not missing_binaries():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _slurm_conf(d: Path, host: str, ctld_port: int, slurmd_port: int, dbd_port: int, cpus: int) -> str:
    mem_mb = 4096
    try:
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
    except (ValueError, OSError):
        pass
    return f"""ClusterName=lowptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={dbd_port}
AccountingStoragePass={d}/munge/munge.socket
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=30
MessageTimeout=10
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


def _slurmdbd_conf(d: Path, dbd_port: int, db_port: int) -> str:
    return f"""AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={dbd_port}
SlurmUser=root
PidFile={d}/run/slurmdbd.pid
LogFile={d}/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser=root
StorageLoc=slurm_acct_db
"""


def _wait(what: str, check, timeout: float, logs: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tails = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))
    raise RuntimeError(f"local Slurm: {what} did not come up within {timeout:.0f}s{tails}")


def _ok(cmd: list[str], env: dict) -> bool:
    return subprocess.run(cmd, env=env, capture_output=True, timeout=20).returncode == 0


class Cluster:
    def __init__(self, state_dir: Path):
        self.dir = Path(state_dir).resolve()
        self.pids: dict[str, int] = {}
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}

    # -- start -------------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        self.pids[name] = proc.pid
        (self.dir / "pids.json").write_text(json.dumps(self.pids))
        time.sleep(0.1)
        if proc.poll() is not None:
            raise RuntimeError(
                f"local Slurm: {name} exited at once:\n{(self.dir / 'log' / f'{name}.out').read_text()}"
            )

    def up(self, cpus: int = 4) -> Cluster:
        d = self.dir
        for sub in ("munge", "db", "state", "spool", "run", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o700)
        host = socket.gethostname().split(".")[0]
        ctld, slurmd, dbd, db = free_ports(4)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        (d / "slurm.conf").write_text(_slurm_conf(d, host, ctld, slurmd, dbd, cpus))
        (d / "slurmdbd.conf").write_text(_slurmdbd_conf(d, dbd, db))
        os.chmod(d / "slurmdbd.conf", 0o600)
        self._spawn(
            "munged",
            [
                _bin("munged"),
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={d}/munge/munge.socket",
                f"--pid-file={d}/run/munged.pid",
                f"--log-file={d}/log/munged.log",
                f"--seed-file={d}/munge/seed",
            ],
        )
        subprocess.run(
            [
                _bin("mariadb-install-db"),
                f"--datadir={d}/db",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            env=self.env,
        )
        # grant tables skipped: a private database on 127.0.0.1 of a throw-away cluster
        self._spawn(
            "mariadbd",
            [
                _bin("mariadbd"),
                "--no-defaults",
                f"--datadir={d}/db",
                "--user=root",
                "--bind-address=127.0.0.1",
                f"--port={db}",
                f"--socket={d}/run/mysqld.sock",
                f"--pid-file={d}/run/mariadbd.pid",
                "--skip-grant-tables",
                f"--log-error={d}/log/mariadbd.log",
            ],
        )
        _wait("mariadbd", lambda: _port_open(db), 60, d / "log")
        self._spawn("slurmdbd", [_bin("slurmdbd"), "-D"])  # reads slurmdbd.conf beside $SLURM_CONF
        _wait("slurmdbd", lambda: _port_open(dbd), 60, d / "log")
        self._spawn("slurmctld", [_bin("slurmctld"), "-D", "-i", "-f", str(d / "slurm.conf")])
        _wait(
            "slurmctld",
            lambda: self._alive("slurmctld") and _ok(["scontrol", "ping"], self.env),
            60,
            d / "log",
        )
        self._spawn("slurmd", [_bin("slurmd"), "-D", "-N", host, "-f", str(d / "slurm.conf")])
        _wait("slurmd", lambda: self._alive("slurmd") and self._node_idle(), 60, d / "log")
        _wait("sacct", lambda: _ok(["sacct", "-n", "-X"], self.env), 30, d / "log")
        return self

    def _alive(self, name: str) -> bool:
        if not _alive(self.pids[name]):
            raise RuntimeError(f"local Slurm: {name} exited; see {self.dir / 'log'}")
        return True

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True)
        return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")

    # -- stop --------------------------------------------------------------------------------------
    def down(self, timeout: float = 90) -> None:
        pids_file = self.dir / "pids.json"
        if pids_file.exists():
            self.pids = json.loads(pids_file.read_text())
        if "slurmctld" in self.pids and _alive(self.pids["slurmctld"]):
            # jobs first, while slurmd runs, so their slurmstepd processes end with them
            subprocess.run(
                ["scancel", "--full", "--state=RUNNING,PENDING,REQUEUED,SUSPENDED", "-u", _user()],
                env=self.env,
                capture_output=True,
                timeout=20,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self._jobs_left():
                time.sleep(0.5)
            if self._jobs_left():  # their slurmstepd processes outlive slurmd: say so, with the ids
                print(
                    f"local Slurm: jobs still ending after {timeout:.0f}s; their slurmstepd processes "
                    "may remain (`ps -C slurmstepd`)",
                    file=sys.stderr,
                )
        for name in reversed(DAEMONS):
            pid = self.pids.get(name)
            if pid is not None:
                _stop(pid, timeout=15)
        pids_file.unlink(missing_ok=True)

    def _jobs_left(self) -> bool:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return out.returncode == 0 and bool(out.stdout.strip())


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of ours counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _stop(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # started by another process (the CLI): poll instead of reaping
            if not _alive(pid):
                return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        raise SystemExit("usage: python tests/slurm/cluster.py up|down STATE_DIR")
    cluster = Cluster(Path(argv[1]))
    if argv[0] == "up":
        if missing_binaries() and not allowed_to_install():
            raise SystemExit(
                f"error: missing {missing_binaries()}; apt-get install {' '.join(APT_PACKAGES)} "
                "(or set LOWP_TEST_SLURM=1 to let this script do it)"
            )
        ensure_installed()
        t0 = time.monotonic()
        cluster.up()
        print(f"# local Slurm up in {time.monotonic() - t0:.1f}s, pids {cluster.pids}", file=sys.stderr)
        print(f"export SLURM_CONF={cluster.dir / 'slurm.conf'}")
    else:
        cluster.down()


if __name__ == "__main__":
    main(sys.argv[1:])
