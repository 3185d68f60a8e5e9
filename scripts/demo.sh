#!/usr/bin/env bash
# The README's first command: sets up dsec on this machine and runs its main
# job, a batch of RL-style rollouts in real container sandboxes.
#
#   ./scripts/demo.sh [-n ROLLOUTS]
#
# Installs the Debian packages dsec needs (QEMU for the microVMs among
# them), builds the binaries and the microVM guest kernel
# (scripts/build-vm-kernel.sh, cached), starts dsecd (state under
# /var/lib/dsec, or $DSEC_DEMO_ROOT) unless one already answers (or
# $DSEC_ADDR, with $DSEC_TOKEN, names another dsec: a cluster, say), builds
# and imports a Debian base layer with Python and the network tools
# (cached after the first run), the guest kernel's modules as a layer
# (scripts/build-vm-modules.sh), the demo's workspace and toolkit layers and
# the systems batch's task layer, and runs demo/rollout.py: the coding
# batch in containers and, beside it, the systems batch in microVMs; then the
# same rollouts as an agent framework on E2B's official SDK runs them
# (demo/e2b/episodes.mjs, on E2B's API that dsecd serves on
# 127.0.0.1:49982, over E2B's base environment). Everything
# the demo creates is deleted at the end; dsecd keeps running (stop it with
# `kill $(cat /var/lib/dsec/dsecd.pid)`; `bin/dsecd teardown` removes all).
# A dsecd the demo starts offers gvisor too where a runsc is found (PATH,
# or scripts/build-runsc.sh's cache): the demo does not build one.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export PATH="$PATH:/usr/local/go/bin:/usr/sbin:/sbin"

if [ "$(id -u)" -ne 0 ]; then
  echo "demo.sh: dsec runs containers and mounts file systems; run it as root" >&2
  exit 1
fi

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "installing packages"
need=()
for cmd in runc mkfs.erofs busybox bash-static debootstrap mkfs.btrfs python3 patch nft ip tar curl \
  qemu-system-x86_64 mkfs.ext4 xz depmod; do
  command -v "$cmd" >/dev/null 2>&1 || need+=("$cmd")
done
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends runc erofs-utils busybox-static bash-static debootstrap \
    btrfs-progs e2fsprogs python3 patch nftables iproute2 tar ca-certificates make curl \
    qemu-system-x86 xz-utils kmod >/dev/null
fi
# Node for the official E2B SDK of the last step.
. scripts/ensure-node.sh
echo "ok"

step "building dsec"
make -s build
echo "bin/dsecd bin/dsec bin/dsec-agent"

# The microVMs' guest kernel: Debian's, unpacked once (a minute the first
# time, then cached); dsecd offers the microvm isolation where it finds it
# and QEMU.
step "microVM guest kernel"
export DSEC_VM_KERNEL_DIR=${DSEC_VM_KERNEL_DIR:-/var/cache/dsec/vm-kernel}
[ -f "$DSEC_VM_KERNEL_DIR/manifest" ] || apt-get update -qq
scripts/build-vm-kernel.sh "$DSEC_VM_KERNEL_DIR"
echo "$(awk '$1 == "kernel" { print $2 }' "$DSEC_VM_KERNEL_DIR/manifest") in $DSEC_VM_KERNEL_DIR"

root=${DSEC_DEMO_ROOT:-/var/lib/dsec}
step "starting dsecd"
if [ -n "${DSEC_ADDR:-}" ]; then
  # Run against the dsec the caller names (scripts/cluster.sh up --demo).
  bin/dsec ls >/dev/null || { echo "demo.sh: nothing answers at DSEC_ADDR=$DSEC_ADDR" >&2; exit 1; }
  echo "using the dsec at $DSEC_ADDR"
elif DSEC_ADDR=unix://$root/dsecd.sock DSEC_TOKEN_FILE=$root/admin.token bin/dsec ls >/dev/null 2>&1; then
  export DSEC_ADDR=unix://$root/dsecd.sock DSEC_TOKEN_FILE=$root/admin.token
  echo "dsecd already answers at $DSEC_ADDR"
else
  export DSEC_ADDR=unix://$root/dsecd.sock DSEC_TOKEN_FILE=$root/admin.token
  mkdir -p $root
  # A swap file of its own lets the preemption's pause take the sandboxes'
  # memory out of RAM (removed again by `bin/dsecd teardown`).
  # --e2b-listen serves E2B's API for the demo's last step.
  nohup bin/dsecd --root $root --swap file:2G --e2b-listen 127.0.0.1:49982 >>$root/dsecd.log 2>&1 &
  echo $! > $root/dsecd.pid
  for _ in $(seq 100); do bin/dsec ls >/dev/null 2>&1 && break; sleep 0.1; done
  bin/dsec ls >/dev/null || { tail -20 $root/dsecd.log; exit 1; }
  echo "dsecd pid $(cat $root/dsecd.pid), log $root/dsecd.log"
fi

have_layer() { bin/dsec layer ls | awk 'NR>1 {print $1}' | tr ',' '\n' | grep -qx "$1"; }

# demo-debian:2 carries the systems batch's tools (ip, nft, modprobe,
# mkfs.ext4) beside Python; its tree is kept in /var/cache/dsec/demo-debian
# (marked by etc/dsec-demo-debian) for another dsecd root.
base=demo-debian:2
step "base layer: Debian with Python and the network tools"
if have_layer $base; then
  echo "cached"
else
  cache=/var/cache/dsec/demo-debian
  if [ ! -f $cache/etc/dsec-demo-debian ]; then
    echo "debootstrap into $cache (a few minutes the first time)"
    scripts/build-demo-debian.sh $cache
  fi
  bin/dsec layer import --kind base --allow-setuid $base $cache
fi

step "the guest kernel's modules, as a layer"
DSEC=bin/dsec scripts/build-vm-modules.sh --import
modules=vm-modules:$(awk '$1 == "kernel" { print $2 }' "$DSEC_VM_KERNEL_DIR/manifest")

step "workspace and toolkit layers"
bin/dsec layer import --kind workspace demo-textstats:1 "$repo/demo/workspace"
bin/dsec layer import --kind toolkit demo-harness:1 "$repo/demo/toolkit"
bin/dsec layer import --kind workspace demo-systems:1 "$repo/demo/systems/layer"

step "rollouts: the coding batch in containers, the systems batch in microVMs"
PYTHONPATH="$repo/sdk/python${PYTHONPATH:+:$PYTHONPATH}" \
  python3 demo/rollout.py --env "$base+demo-textstats:1+demo-harness:1" \
    --systems-env "$base+$modules+demo-systems:1" "$@"

step "the rollouts through E2B's official SDK"
# An agent framework written against E2B (npm e2b, unchanged) runs the same
# episodes on this dsec: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY from
# `dsec e2b env` are all it needs.
e2b_addr=${DSEC_E2B_ADDR:-http://127.0.0.1:49982}
if ! curl -fsS -o /dev/null "$e2b_addr/health" 2>/dev/null; then
  echo "skipped: nothing serves E2B's API at $e2b_addr (start dsecd with --e2b-listen, or set DSEC_E2B_ADDR)"
  exit 0
fi
if have_layer e2b-base:latest; then
  echo "E2B's base environment: cached"
else
  echo "E2B's base environment: debootstrap (about a minute the first time)"
  scripts/build-e2b-base.sh --import >/dev/null
fi
(cd demo/e2b && npm ci --no-audit --no-fund --silent)
eval "$(bin/dsec e2b env --e2b-addr "$e2b_addr")"
node demo/e2b/episodes.mjs --template "e2b-base:latest+demo-textstats:1+demo-harness:1" -n 8
