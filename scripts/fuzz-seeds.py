#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs into fuzz/seeds/<target>/: the conversations and
files the tests and docs exercise, built here byte for byte (NBD sessions, FUSE requests,
vhost-user messages, virtqueues), taken from the documentation (configurations, control
calls), or made by cryptsetup (LUKS headers, when it is installed). Inputs kept there by hand
are findings of earlier runs, replayed by every run as regressions."""

import json, os, re, struct, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEEDS = os.path.join(ROOT, "fuzz", "seeds")


def put(target, name, data):
    d = os.path.join(SEEDS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# --- configurations: every TOML block of the docs, and the shipped example -------------------
def config_seeds():
    n = 0
    for doc in ["docs/config.md", "docs/operations.md", "docs/vm.md", "README.md"]:
        text = open(os.path.join(ROOT, doc)).read()
        for block in re.findall(r"```toml\n(.*?)```", text, re.S):
            put("config_toml", f"doc-{n:02}.toml", block)
            n += 1
    put("config_toml", "example.toml", open(os.path.join(ROOT, "packaging", "bulkhead.toml")).read())


# --- control calls: the requests of docs/control.md, one per line ----------------------------
def control_seeds():
    text = open(os.path.join(ROOT, "docs", "control.md")).read()
    lines = [l[2:].strip() for l in text.splitlines() if l.startswith("→ ")]
    for i, l in enumerate(lines):
        put("control_frame", f"call-{i:02}", l + "\n")
    put("control_frame", "all", "\n".join(lines) + "\n")


# --- attach lines: what an application says, and a domain ------------------------------------
def attach_seeds():
    app = [{"queues": {"count": 2}}, {"restarted": {"generation": 3}}, {"refused": {"why": "no memory"}}]
    put("attach_message", "app", "".join(json.dumps(m) + "\n" for m in app))
    for i, m in enumerate([{"added": {"slot": 1}}, {"removed": {"slot": 0}}, {"refused": {"slot": 2, "why": "bad ring"}}]):
        put("attach_message", f"domain-{i}", json.dumps(m))


# --- NBD: client conversations --------------------------------------------------------------
NBD_OPT = 0x49484156454F5054
REQ_MAGIC = 0x25609513


def opt(code, data=b""):
    return struct.pack(">QII", NBD_OPT, code, len(data)) + data


def info_go(code, name, infos=(0, 1, 3)):
    n = name.encode()
    return opt(code, struct.pack(">I", len(n)) + n + struct.pack(">H", len(infos)) + b"".join(struct.pack(">H", i) for i in infos))


def req(flags, typ, handle, offset, length, data=b""):
    return struct.pack(">IHHQQI", REQ_MAGIC, flags, typ, handle, offset, length) + data


def nbd_seeds():
    hello = struct.pack(">I", 3)  # fixed newstyle, no zeroes
    io = (req(0, 1, 1, 0, 4096, bytes(range(256)) * 16) + req(0, 0, 2, 0, 4096) + req(1, 1, 3, 8192, 512, b"\xaa" * 512)
          + req(0, 3, 4, 0, 0) + req(0, 4, 5, 0, 65536) + req(0, 6, 6, 65536, 4096) + req(0, 2, 7, 0, 0))
    put("nbd_connection", "go-io", hello + opt(8) + info_go(7, "disk0") + io)
    put("nbd_connection", "list-info-export-name", hello + opt(3) + info_go(6, "ro") + opt(1, b"ro") + req(0, 0, 1, 0, 512) + req(0, 2, 2, 0, 0))
    meta = b"base:allocation"
    q = struct.pack(">I", 5) + b"disk0" + struct.pack(">I", 1) + struct.pack(">I", len(meta)) + meta
    put("nbd_connection", "meta-block-status", hello + opt(8) + opt(10, q) + opt(9, q) + info_go(7, "disk0")
        + req(0, 7, 1, 0, 65536) + req(0, 2, 2, 0, 0))
    put("nbd_connection", "starttls", hello + opt(5) + b"\x16\x03\x01\x00\x05hello")
    put("nbd_connection", "abort", hello + opt(2))


# --- FUSE: requests as the kernel sends them ------------------------------------------------
def fuse(op, unique, nodeid, body=b""):
    return struct.pack("<IIQQIIIHH", 40 + len(body), op, unique, nodeid, 0, 0, 1, 0, 0) + body


def fuse_seeds():
    init = fuse(26, 1, 0, struct.pack("<IIII", 7, 41, 1 << 17, 0x7FFFFFFF) + struct.pack("<I", 0x1FF) + bytes(44))
    lookup = fuse(1, 2, 1, b"disk0\0")
    getattr_ = fuse(3, 3, 2, struct.pack("<IIQ", 0, 0, 0))
    open_ = fuse(14, 4, 2, struct.pack("<II", os.O_RDWR, 0))
    write = fuse(16, 5, 2, struct.pack("<QQIIQII", 0, 4096, 512, 0, 0, os.O_RDWR, 0) + b"\x5a" * 512)
    read = fuse(15, 6, 2, struct.pack("<QQIIQII", 0, 4096, 512, 0, 0, os.O_RDWR, 0))
    fsync = fuse(20, 7, 2, struct.pack("<QII", 0, 0, 0))
    punch = fuse(43, 8, 2, struct.pack("<QQQII", 0, 0, 4096, 0x03, 0))
    zero = fuse(43, 9, 2, struct.pack("<QQQII", 0, 8192, 4096, 0x10, 0))
    release = fuse(18, 10, 2, struct.pack("<QIIQ", 0, 0, 0, 0))
    forget = fuse(2, 11, 2, struct.pack("<Q", 1))
    readdir = fuse(27, 12, 1, struct.pack("<II", 0, 0)) + fuse(28, 13, 1, struct.pack("<QQIIQII", 0, 0, 4096, 0, 0, 0, 0))
    ro_write = fuse(1, 14, 1, b"ro\0") + fuse(14, 15, 3, struct.pack("<II", os.O_WRONLY, 0))
    statfs = fuse(17, 16, 1)
    destroy = fuse(38, 17, 0)
    put("fuse_request", "session", init + lookup + getattr_ + open_ + write + read + fsync + punch + zero + release + forget + destroy)
    put("fuse_request", "dir-and-ro", init + readdir + ro_write + statfs)
    put("fuse_request", "init-only", init)


# --- vhost-user: messages of a frontend's set-up --------------------------------------------
def vu(req, payload=b"", flags=1):
    return struct.pack("<III", req, flags, len(payload)) + payload


def vhost_message_seeds():
    u64 = lambda v: struct.pack("<Q", v)
    state = lambda i, n: struct.pack("<II", i, n)
    setup = (vu(1) + vu(3) + vu(15) + vu(16, u64(0x2000 | 0x200 | 0x1 | 0x8)) + vu(2, u64((1 << 32) | (1 << 28) | (1 << 29) | (1 << 30)))
             + vu(17) + vu(24, struct.pack("<III", 0, 60, 0) + bytes(60)) + vu(8, state(0, 256)) + vu(10, state(0, 0))
             + vu(31, struct.pack("<QQHH", 0, 0, 2, 256)) + vu(11, state(0, 0)) + vu(18, state(0, 1)))
    put("vhost_message", "setup", setup)
    put("vhost_message", "features", vu(1) + vu(15) + vu(17))


# --- virtqueues: chains of a virtio-blk driver ----------------------------------------------
BASE = 0x10000


def desc(addr, length, flags, nxt):
    return struct.pack("<QIHH", addr, length, flags, nxt)


def virtq_seed(size_bits, flags, chains, extra):
    """chains: lists of descriptors (addr, len, flags, next) starting at index 0; extra: bytes
    to place at guest offsets."""
    size = 1 << size_bits
    mem = bytearray(16 << 10)
    table = b""
    heads = []
    for c in chains:
        heads.append(len(table) // 16)
        table += b"".join(desc(*d) for d in c)
    mem[0:len(table)] = table
    avail = 16 * size
    mem[avail:avail + 4] = struct.pack("<HH", 0, len(heads))
    for i, h in enumerate(heads):
        mem[avail + 4 + 2 * i:avail + 6 + 2 * i] = struct.pack("<H", h)
    for off, b in extra:
        mem[off:off + len(b)] = b
    return bytes([size_bits, flags, 0, 0]) + bytes(mem)


def vhost_virtqueue_seeds():
    NEXT, WRITE, INDIRECT = 1, 2, 4
    hdr = lambda t, sector: struct.pack("<IIQ", t, 0, sector)
    # read: header, 512 bytes in, status; write: header, 512 bytes out, status; flush; get id
    read = [(BASE + 0x1000, 16, NEXT, 1), (BASE + 0x2000, 512, NEXT | WRITE, 2), (BASE + 0x3000, 1, WRITE, 0)]
    write = [(BASE + 0x1100, 16, NEXT, 4), (BASE + 0x2200, 512, NEXT, 5), (BASE + 0x3001, 1, WRITE, 0)]
    flush = [(BASE + 0x1200, 16, NEXT, 7), (BASE + 0x3002, 1, WRITE, 0)]
    getid = [(BASE + 0x1300, 16, NEXT, 9), (BASE + 0x2400, 20, NEXT | WRITE, 10), (BASE + 0x3003, 1, WRITE, 0)]
    extra = [(0x1000, hdr(0, 0)), (0x1100, hdr(1, 8)), (0x1200, hdr(4, 0)), (0x1300, hdr(8, 0))]
    put("vhost_virtqueue", "read-write-flush-id", virtq_seed(4, 1, [read, write, flush, getid], extra))
    # an indirect table holding a discard
    table = desc(BASE + 0x1400, 16, NEXT, 1) + desc(BASE + 0x2600, 16, NEXT, 2) + desc(BASE + 0x3004, 1, WRITE, 0)
    ind = [(BASE + 0x2800, len(table), INDIRECT, 0)]
    extra = [(0x1400, hdr(11, 0)), (0x2600, struct.pack("<QII", 0, 8, 0)), (0x2800, table)]
    put("vhost_virtqueue", "indirect-discard", virtq_seed(3, 3, [ind], extra))


# --- LUKS: headers made by cryptsetup -------------------------------------------------------
def luks_seeds():
    if subprocess.run(["sh", "-c", "command -v cryptsetup"], capture_output=True).returncode != 0:
        print("cryptsetup not installed: no LUKS seeds", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory() as d:
        for kind, args, keep in [
            ("luks1", ["--type", "luks1", "--pbkdf-force-iterations", "1000", "--key-size", "256"], 4096 + 128 * 1024),
            ("luks2", ["--type", "luks2", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--key-size", "256",
                       "--luks2-metadata-size", "16k", "--luks2-keyslots-size", "256k"], 32768 + 256 * 1024),
        ]:
            img = os.path.join(d, kind)
            with open(img, "wb") as f:
                f.truncate(4 << 20)
            subprocess.run(["cryptsetup", "luksFormat", "-q", "--batch-mode", *args, img, "-"], input=b"fuzz", check=True,
                           capture_output=True)
            data = open(img, "rb").read()
            put("luks_header", kind, data[:keep])
            put("luks_header", kind + "-header-only", data[:32768 if kind == "luks2" else 4096])


if __name__ == "__main__":
    config_seeds(); control_seeds(); attach_seeds(); nbd_seeds(); fuse_seeds()
    vhost_message_seeds(); vhost_virtqueue_seeds(); luks_seeds()
    for t in sorted(os.listdir(SEEDS)):
        print(f"{t}: {len(os.listdir(os.path.join(SEEDS, t)))} seeds")
