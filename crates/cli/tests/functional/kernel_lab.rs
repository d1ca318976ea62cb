//! The kernel's own block devices. On a host without ublk (this one's kernel may lack it),
//! `serve` refuses the ublk export at once, naming the key and what is missing. In the kernel
//! lab (a TCG guest of bookworm-backports' 6.12, which has ublk and nbd, running this host's
//! `bulkhead`): ext4 on `/dev/ublkb0` under fio's verifying writes survives 10 driver-domain
//! kills, 3 SIGKILLs of `serve` with the keeper and 2 upgrades, with no I/O error and a clean
//! e2fsck; a read-only view is a read-only block device; a stop deletes the block devices.
//! And the kernel's NBD client on the NBD export: ext4 on `/dev/nbd0` works, and a SIGKILL of
//! `serve` costs it its in-flight writes, with or without `-persist` (docs/ublk.md).

#[path = "../common/mod.rs"]
mod common;

use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use bulkhead_guest::{Lab, LabOptions, Vm};
use common::*;

#[test]
fn a_host_without_ublk_refuses_the_export_naming_the_key_and_what_is_missing() {
    if std::path::Path::new("/dev/ublk-control").exists() {
        eprintln!("SKIP: this host has ublk");
        return;
    }
    let tmp = TempDir::new("ublk-refused");
    let cfg = tmp.path().join("bh.toml");
    std::fs::write(
        &cfg,
        "[fuse]\nenabled = false\n[ublk]\nenabled = true\n[[device]]\nname = \"d\"\nsize = \"16M\"\n[device.backend]\ntype = \"ram\"\n",
    )
    .unwrap();
    let run = tmp.path().join("run");
    let out =
        Command::new("timeout").args(["60", exe(), "serve", "--config"]).arg(&cfg).arg("--run-dir").arg(&run).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("key `ublk.enabled`") && err.contains("/dev/ublk-control does not exist"), "{err}");
    assert!(err.contains("ublk_drv") || err.contains("Linux"), "the message says what is missing: {err}");
    // Refused before any domain started: nothing is left running or bound.
    assert!(!run.join("control.sock").exists());
}

/// One guest at a time: two TCG guests on two cores would stretch every pause the tests wait
/// out.
static GUEST: Mutex<()> = Mutex::new(());

/// The lab, or `None` (the test skips) where QEMU is missing and the kernel tests are not
/// required.
fn lab() -> Option<Lab> {
    if bulkhead_testkit::kernel::which("qemu-system-x86_64").is_none() {
        assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "qemu-system-x86_64 required but not installed");
        eprintln!("SKIP: qemu-system-x86_64 not installed");
        return None;
    }
    Some(Lab::ensure().unwrap_or_else(|e| panic!("kernel lab: {e}")))
}

/// The guest's script: `serve` with the keeper and the ublk export of a ram device and a
/// read-only view of it, ext4 on the device under fio's verifying writes while the faults
/// come, then the checks. Each result is a line the test reads.
fn script(bulkhead: &str) -> String {
    format!(
        r#"
B={bulkhead}
RUN=/run/bh
cat > /run/bh.toml <<'CFG'
[keeper]
enabled = true
[fuse]
enabled = false
[nbd]
enabled = false
[ublk]
enabled = true
numbers = {{ d = 0, d-ro = 1 }}
[[device]]
name = "d"
size = "512M"
# Ten kills in a minute are this test's doing, not a crash loop.
restart_limit = 100
[device.backend]
type = "ram"
[[device.view]]
name = "d-ro"
read_only = true
CFG
$B serve --config /run/bh.toml --run-dir $RUN > /run/serve.log 2>&1 &
KP=$!
for i in $(seq 1 150); do [ -b /dev/ublkb0 ] && [ -b /dev/ublkb1 ] && break; sleep 0.2; done
js() {{ $B status --run-dir $RUN --json | python3 -c "import json,sys; r=json.load(sys.stdin); print($1)"; }}
serve_pid() {{ js "r['frontend']['pid']" 2>/dev/null || true; }}
ms() {{ echo $(( $(date +%s%N) / 1000000 )); }}
# What the guest looked like, for a failure's message: each process with its state and where
# it waits in the kernel, the kernel stacks of serve's threads, and the end of serve's log.
diag() {{
  echo "UBLK-DIAG $1"
  for p in /proc/[0-9]*; do
    c=$(tr '\0' ' ' < $p/cmdline 2>/dev/null)
    [ -n "$c" ] && echo "UBLK-PS ${{p#/proc/}} $(cut -d' ' -f3,4 $p/stat) $(cat $p/wchan 2>/dev/null) $c"
  done
  for p in $(pgrep -f "$B serve"); do
    for t in /proc/$p/task/*; do echo "UBLK-STACK $p ${{t##*/}} $(cat $t/comm) $(tr '\n' ' ' < $t/stack)"; done
  done
  tail -n 120 /run/serve.log | sed 's/^/UBLK-SERVELOG /'
}}
# Another run directory's serve asking for a number that is taken is refused, naming both.
printf '[fuse]\nenabled = false\n[nbd]\nenabled = false\n[ublk]\nenabled = true\nnumbers = {{ e = 0 }}\n[[device]]\nname = "e"\nsize = "16M"\n[device.backend]\ntype = "ram"\n' > /run/other.toml
if timeout 60 $B serve --config /run/other.toml --run-dir /run/other > /run/other.log 2>&1; then echo UBLK-TAKEN-ACCEPTED; fi
grep -q '`e`: /dev/ublkb0 is already there' /run/other.log && echo UBLK-TAKEN-REFUSED || cat /run/other.log
echo "UBLK-RO $(blockdev --getro /dev/ublkb1)"
if dd if=/dev/zero of=/dev/ublkb1 bs=4k count=1 oflag=direct status=none 2>/dev/null; then echo UBLK-RO-WRITE-ACCEPTED; else echo UBLK-RO-WRITE-REFUSED; fi
mkfs.ext4 -q /dev/ublkb0
mkdir -p /run/m
mount /dev/ublkb0 /run/m
( fio --name=v --directory=/run/m --size=48M --bs=4k --rw=randwrite --ioengine=psync --direct=1 --fsync=64 \
    --verify=crc32c --verify_fatal=1 --time_based --runtime=75 --numjobs=2 --group_reporting > /run/fio.out 2>&1
  echo $? > /run/fio.rc ) &
sleep 3
last=0
for k in 1 2 3 4 5 6 7 8 9 10; do
  # The domain that replaced the last one killed, once it serves.
  dp=0
  for i in $(seq 1 300); do
    dp=$(js "r['devices'][0]['driver_pid'] if r['devices'][0]['state'] == 'running' else 0" 2>/dev/null || echo 0)
    [ "$dp" != 0 ] && [ "$dp" != "$last" ] && break
    sleep 0.2
  done
  [ "$dp" != 0 ] && [ "$dp" != "$last" ] || {{ echo "UBLK-NO-DOMAIN $k"; break; }}
  kill -9 "$dp"
  last=$dp
  echo "UBLK-DOMAIN-KILLED $k $dp"
  sleep 1
done
for k in 1 2 3; do
  sp=$(serve_pid)
  [ -n "$sp" ] && [ "$sp" != 0 ] || {{ echo "UBLK-NO-SERVE $k"; break; }}
  kill -9 "$sp"
  # A write through the file system waits for the next serve: how long is the pause.
  t0=$(ms)
  dd if=/dev/zero of=/run/m/probe bs=4k count=1 oflag=direct conv=fsync status=none
  echo "UBLK-PAUSE-MS $k $(( $(ms) - t0 ))"
  np=$sp
  for i in $(seq 1 150); do sleep 0.2; np=$(serve_pid); [ -n "$np" ] && [ "$np" != "$sp" ] && break; done
  echo "UBLK-SERVE-KILLED $k $sp $np"
  sleep 2
done
for k in 1 2; do
  if $B upgrade --run-dir $RUN; then echo "UBLK-UPGRADED $k"; else diag "upgrade $k"; fi
  sleep 2
done
$B status --run-dir $RUN | grep '^ublk:' | sed 's/^/UBLK-STATUS /'
# fio ends by itself at 75 s: one that has not a minute and a half later waits on a write that
# never completes, which is said with what the guest looked like rather than left to hang.
for i in $(seq 1 450); do [ -f /run/fio.rc ] && break; sleep 0.2; done
[ -f /run/fio.rc ] || {{ diag fio-hung; exit 1; }}
echo "UBLK-FIO-EXIT $(cat /run/fio.rc)"
grep -E 'err=|verify' /run/fio.out || true
umount /run/m
e2fsck -fn /dev/ublkb0 > /run/fsck.out 2>&1 && echo UBLK-FSCK-CLEAN || cat /run/fsck.out
kill $KP
wait $KP || true
ls /dev/ublkb0 /dev/ublkb1 2>/dev/null || echo UBLK-DEVICES-DELETED
# Besides the keeper's word on each kill, the test's doing.
grep -iE 'warning|error' /run/serve.log | grep -v 'keeper: serve (pid [0-9]*) was killed by signal 9' | sed 's/^/UBLK-LOG /' || true
"#
    )
}

#[test]
fn ext4_on_a_ublk_device_survives_domain_kills_serve_kills_and_upgrades() {
    let Some(lab) = lab() else { return };
    let _one = GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = TempDir::new("ublk-lab");
    let opts = LabOptions { script: script(exe()), memory_mib: 2048, cpus: 2, scratch: tmp.path().join("initrd") };
    let vm = Vm::boot_lab(&lab, &opts).unwrap_or_else(|e| panic!("{e}"));
    let out = vm.finish(Duration::from_secs(600));
    // Kept in the build's scratch dir for a look after a failure.
    bulkhead_guest::save_console(&std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("ublk-lab-console.log"), &out.lines);
    let text = out.script_output();
    let has = |l: &str| out.lines.iter().any(|x| x.trim() == l);
    let count = |p: &str| out.with_prefix(p).count();
    assert!(has("UBLK-RO 1") && has("UBLK-RO-WRITE-REFUSED"), "the read-only view is a read-only block device:\n{text}");
    assert!(has("UBLK-TAKEN-REFUSED"), "a number another serve holds is refused, naming the device:\n{text}");
    assert_eq!(count("UBLK-DOMAIN-KILLED"), 10, "{text}");
    assert_eq!(count("UBLK-SERVE-KILLED"), 3, "{text}");
    for l in out.with_prefix("UBLK-SERVE-KILLED") {
        let f: Vec<&str> = l.split_whitespace().collect();
        assert!(f.len() == 4 && f[2] != f[3], "a new serve took over after each kill: {l}\n{text}");
    }
    assert_eq!(count("UBLK-PAUSE-MS"), 3, "a write waited for each next serve and succeeded: {text}");
    assert_eq!(count("UBLK-UPGRADED"), 2, "{text}");
    assert!(out.with_prefix("UBLK-STATUS").any(|l| l.contains("/dev/ublkb0 is d (taken over")), "{text}");
    assert!(has("UBLK-FIO-EXIT 0") && text.contains("err= 0"), "fio verified every block: {text}");
    assert!(has("UBLK-FSCK-CLEAN"), "{text}");
    assert!(has("UBLK-DEVICES-DELETED"), "a stop deletes the block devices:\n{text}");
    assert_eq!(count("UBLK-LOG"), 0, "serve logged no warning or error:\n{text}");
    out.check().unwrap_or_else(|e| panic!("{e}"));
}

/// The guest's script for the kernel's NBD client, connected as `nbd-client` does by default
/// (netlink) to `/dev/nbd0` and with `-nonetlink -persist` (reconnect) to `/dev/nbd1`, each to a
/// `serve` of its own with the keeper: ext4 under fio's verifying writes, then `serve`
/// SIGKILLed under the same load, and what the client makes of it.
fn nbd_script(bulkhead: &str) -> String {
    format!(
        r#"
B={bulkhead}
js() {{ $B status --run-dir $1 --json | python3 -c "import json,sys; r=json.load(sys.stdin); print(r['frontend']['pid'])"; }}
ms() {{ echo $(( $(date +%s%N) / 1000000 )); }}
one() {{
  mode=$1 dev=$2 run=/run/bh-$1 m=/run/m-$1
  shift 2
  printf '[keeper]\nenabled = true\n[fuse]\nenabled = false\n[[device]]\nname = "d"\nsize = "512M"\n[device.backend]\ntype = "ram"\n' > $run.toml
  $B serve --config $run.toml --run-dir $run > $run.log 2>&1 &
  kp=$!
  for i in $(seq 1 150); do [ -S $run/nbd.sock ] && break; sleep 0.2; done
  nbd-client -unix $run/nbd.sock $dev -N d -b 4096 -t 30 "$@"
  mkfs.ext4 -q $dev
  mkdir -p $m
  mount $dev $m
  rc=0
  fio --name=v --directory=$m --size=32M --bs=4k --rw=randwrite --ioengine=psync --direct=1 --fsync=64 \
      --verify=crc32c --verify_fatal=1 --runtime=8 --time_based > $run.fio1 2>&1 || rc=$?
  echo "NBD-FIO-BEFORE $mode $rc"
  fio --name=v --directory=$m --size=32M --bs=4k --rw=randwrite --ioengine=psync --direct=1 --fsync=64 \
      --verify=crc32c --verify_fatal=1 --runtime=20 --time_based > $run.fio2 2>&1 &
  fp=$!
  sleep 3
  sp=$(js $run)
  t0=$(ms)
  kill -9 $sp
  np=$sp
  for i in $(seq 1 150); do sleep 0.1; np=$(js $run 2>/dev/null || true); [ -n "$np" ] && [ "$np" != "$sp" ] && break; done
  echo "NBD-SERVE-BACK-MS $mode $(( $(ms) - t0 ))"
  rc=0
  wait $fp || rc=$?
  echo "NBD-FIO-AFTER $mode $rc $(grep -c 'Input/output error' $run.fio2)"
  sleep 2
  if dd if=$dev of=/dev/null bs=4k count=1 iflag=direct status=none; then echo "NBD-READ-AFTER $mode ok"; else echo "NBD-READ-AFTER $mode failed"; fi
  d=$(basename $dev)
  # ext4 learns of the lost writes when it next writes its journal: on its commit timer, or at
  # the latest at unmount. Looked for once unmounted, so that it has.
  umount $m || umount -l $m
  dmesg | grep -qE "Aborting journal on device $d|EXT4-fs \($d\).*shut down" && echo "NBD-EXT4-ABORTED $mode"
  nbd-client -d $dev || true
  kill $kp
  wait $kp || true
}}
one netlink /dev/nbd0
one persist /dev/nbd1 -nonetlink -persist
"#
    )
}

#[test]
fn ext4_on_the_kernel_nbd_client_works_and_a_serve_crash_costs_it_its_writes() {
    let Some(lab) = lab() else { return };
    if bulkhead_testkit::kernel::which("nbd-client").is_none() {
        assert!(std::env::var("BULKHEAD_REQUIRE_KERNEL").as_deref() != Ok("1"), "nbd-client required but not installed");
        eprintln!("SKIP: nbd-client not installed");
        return;
    }
    let _one = GUEST.lock().unwrap_or_else(|e| e.into_inner());
    let tmp = TempDir::new("nbd-lab");
    let opts = LabOptions { script: nbd_script(exe()), memory_mib: 2048, cpus: 2, scratch: tmp.path().join("initrd") };
    let vm = Vm::boot_lab(&lab, &opts).unwrap_or_else(|e| panic!("{e}"));
    let out = vm.finish(Duration::from_secs(400));
    bulkhead_guest::save_console(&std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("nbd-lab-console.log"), &out.lines);
    let text = out.script_output();
    let has = |l: &str| out.lines.iter().any(|x| x.trim() == l);
    for mode in ["netlink", "persist"] {
        assert!(has(&format!("NBD-FIO-BEFORE {mode} 0")), "ext4 on the kernel's NBD client works ({mode}):\n{text}");
        // What docs/ublk.md says of the kernel's NBD client: the crash costs in-flight writes
        // (EIO to fio, ext4 aborts its journal), and the device does not come back by itself.
        let prefix = format!("NBD-FIO-AFTER {mode} ");
        let after = out.with_prefix(&prefix).next().unwrap_or_else(|| panic!("{text}")).trim();
        assert!(!after.ends_with(" 0 0"), "a serve crash under the kernel NBD client was not seen ({mode}): {after}\n{text}");
        assert!(has(&format!("NBD-EXT4-ABORTED {mode}")), "{text}");
        assert!(out.with_prefix(&format!("NBD-SERVE-BACK-MS {mode} ")).count() == 1, "{text}");
    }
    // The only errors are the NBD devices' after the kills, which the test is about.
    assert_eq!(out.status, Some(0), "the guest's script failed:\n{text}");
    let other: Vec<&String> = out.errors().into_iter().filter(|l| !l.contains("nbd")).collect();
    assert!(other.is_empty(), "errors besides the NBD devices': {other:?}\n{text}");
}
