# The guest's half of `bulkhead-bench ublk`: runs in the kernel lab (the host's programs over
# 9p on a kernel with ublk and nbd). Brings each system up in turn on the same backing file,
# runs fio's points against its block device, and prints one line per point:
#   UBLKBENCH {"kind": "point", "system": ..., "round": ..., "point": ..., "requests": ...,
#              "bytes": ..., "seconds": ..., "server_cpu": ..., "domains_cpu": ..., "guest_cpu": ...}
# (server_cpu: the server's processes, `serve` and its domains or rublk's daemon; domains_cpu:
# bulkhead's domains alone; guest_cpu: every vCPU's busy time)
# and {"kind": "error", ...} where a system could not be brought up or a point failed.
# argv[1] is the JSON of the options (see ublk.rs, `GuestPlan`).
import json
import os
import subprocess
import sys
import time

plan = json.loads(sys.argv[1])
B = plan["bulkhead"]
IMG = "/run/bench.img"
TICK = os.sysconf("SC_CLK_TCK")


def say(kind, **kv):
    print("UBLKBENCH " + json.dumps({"kind": kind, **kv}), flush=True)


def run(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True)


def wait_for(test, what, seconds=60):
    end = time.time() + seconds
    while time.time() < end:
        if test():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not appear within {seconds} s")


def stats():
    """Each process's parent and CPU seconds (user + system, all threads)."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:
            continue
        rest = s[s.rindex(")") + 2:].split()
        comm = s[s.index("(") + 1:s.rindex(")")]
        out[int(p)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / TICK, comm)
    return out


def server_cpu(roots, comm=None):
    """CPU seconds of `roots` and all their descendants (or of every process named `comm`),
    and of the descendants alone."""
    st = stats()
    if comm is not None:
        return sum(c for (_, c, n) in st.values() if n == comm), 0.0
    keep = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _, _) in st.items():
            if ppid in keep and pid not in keep:
                keep.add(pid)
                grew = True
    total = sum(st[p][1] for p in keep if p in st)
    return total, total - sum(st[p][1] for p in roots if p in st)


def guest_busy():
    """The whole guest's busy CPU seconds (every vCPU, kernel threads included)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / TICK


class Bulkhead:
    """`bulkhead serve` with a `file` device on IMG, exported as `export` says."""

    def __init__(self, export):
        self.export = export
        self.run = f"/run/bh-{export}"
        cfg = [
            "[fuse]", f"enabled = {'true' if export == 'loop-fuse' else 'false'}",
            "[nbd]", f"enabled = {'true' if export == 'nbd' else 'false'}",
            "[ublk]", f"enabled = {'true' if export == 'ublk' else 'false'}", "numbers = { d = 0 }",
            "[[device]]", 'name = "d"', f"queues = {plan['queues']}",
            "[device.backend]", 'type = "file"', f'path = "{IMG}"', "direct = true",
        ]
        with open(self.run + ".toml", "w") as f:
            f.write("\n".join(cfg) + "\n")
        self.log = open(self.run + ".log", "w")
        self.proc = subprocess.Popen([B, "serve", "--config", self.run + ".toml", "--run-dir", self.run],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.loop = None
        if export == "ublk":
            wait_for(lambda: os.path.exists("/dev/ublkb0"), "/dev/ublkb0")
            self.dev = "/dev/ublkb0"
        elif export == "loop-fuse":
            f = f"{self.run}/fuse/d"
            wait_for(lambda: os.path.exists(f), f)
            self.loop = run("losetup", "--direct-io=on", "-f", "--show", f).stdout.strip()
            self.dev = self.loop
        else:
            sock = f"{self.run}/nbd.sock"
            wait_for(lambda: os.path.exists(sock), sock)
            run("nbd-client", "-unix", sock, "/dev/nbd0", "-N", "d", "-b", "4096")
            self.dev = "/dev/nbd0"

    def cpu(self):
        return server_cpu([self.proc.pid])

    def stop(self):
        if self.loop:
            run("losetup", "-d", self.loop)
        if self.export == "nbd":
            run("nbd-client", "-d", "/dev/nbd0")
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


class Rublk:
    """rublk's `loop` target on IMG (O_DIRECT, as bulkhead's device)."""

    def __init__(self):
        self.bin = plan["rublk"]
        run(self.bin, "add", "loop", "-n", "9", "-q", str(plan["queues"]), "-d", str(plan["depth"]), "-f", IMG)
        wait_for(lambda: os.path.exists("/dev/ublkb9"), "/dev/ublkb9")
        self.dev = "/dev/ublkb9"

    def cpu(self):
        return server_cpu([], comm="rublk")

    def stop(self):
        run(self.bin, "del", "-n", "9")


SYSTEMS = {
    "ublk": lambda: Bulkhead("ublk"),
    "loop-fuse": lambda: Bulkhead("loop-fuse"),
    "nbd": lambda: Bulkhead("nbd"),
    "rublk": Rublk,
}


def point(name, system, r, p):
    fio = ["fio", "--name=p", f"--filename={system.dev}", "--direct=1", "--ioengine=libaio", f"--rw={p['rw']}",
           f"--bs={p['bs']}", f"--iodepth={p['qd']}", f"--runtime={plan['seconds']}", "--time_based",
           f"--size={plan['size_mib']}M", "--output-format=json", "--randrepeat=0"]
    (c0, d0), g0, t0 = system.cpu(), guest_busy(), time.time()
    out = subprocess.run(fio, capture_output=True, text=True)
    (c1, d1), g1, t1 = system.cpu(), guest_busy(), time.time()
    if out.returncode != 0:
        raise RuntimeError(f"fio: {out.stderr.strip() or out.stdout.strip()}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    if job["error"] != 0:
        raise RuntimeError(f"fio: error {job['error']}")
    requests = job["read"]["total_ios"] + job["write"]["total_ios"]
    moved = job["read"]["io_bytes"] + job["write"]["io_bytes"]
    seconds = (job["read"]["runtime"] or job["write"]["runtime"]) / 1000
    say("point", system=name, round=r, point=p["name"], requests=requests, bytes=moved, seconds=seconds,
        server_cpu=c1 - c0, domains_cpu=d1 - d0, guest_cpu=g1 - g0, wall=t1 - t0)


run("dd", "if=/dev/urandom", f"of={IMG}", "bs=1M", f"count={plan['size_mib']}", "status=none")
names = plan["systems"]
for r in range(plan["rounds"]):
    # Alternated: each round starts one system later.
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
        say("progress", what=f"round {r + 1}/{plan['rounds']}: {name}")
        try:
            system = SYSTEMS[name]()
        except Exception as e:  # a system that can't come up is reported, the others still run
            say("error", system=name, round=r, what=str(e))
            continue
        try:
            for p in plan["points"]:
                point(name, system, r, p)
        except Exception as e:
            say("error", system=name, round=r, what=str(e))
        finally:
            try:
                system.stop()
            except Exception as e:
                say("error", system=name, round=r, what=f"stop: {e}")
say("end")
