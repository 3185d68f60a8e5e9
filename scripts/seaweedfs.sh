#!/usr/bin/env bash
# Builds and runs a local SeaweedFS server with its S3 gateway, for testing
# dsec's S3 blob store (internal/blob) against a real S3 server.
#
#   scripts/seaweedfs.sh build            build weed into $DSEC_CACHE/weed (once)
#   scripts/seaweedfs.sh start DIR PORT   run weed with data in DIR, S3 on 127.0.0.1:PORT
#   scripts/seaweedfs.sh stop DIR         stop the weed started with DIR
#
# Example: scripts/seaweedfs.sh start /tmp/weed 8333 &&
#          DSEC_TEST_S3=127.0.0.1:8333 go test ./internal/blob/
set -euo pipefail

WEED_MODULE="github.com/seaweedfs/seaweedfs"
WEED_VERSION="v0.0.0-20261109003541-7506e5f91cd6"
CACHE="${DSEC_CACHE:-/var/cache/dsec}"
WEED="$CACHE/weed"
. "$(dirname "$0")/lib/gomodule.sh"

usage() {
  echo "usage: $0 build | start DIR PORT | stop DIR" >&2
  exit 2
}

build() {
  if [ -x "$WEED" ]; then
    echo "weed already built: $WEED"
    return 0
  fi
  mkdir -p "$CACHE"
  BUILD_TMP="$(mktemp -d)"
  trap 'rm -rf "$BUILD_TMP"' EXIT
  module_source "$WEED_MODULE" "$WEED_VERSION" "$BUILD_TMP/src"
  (cd "$BUILD_TMP/src" && go build -o "$BUILD_TMP/weed" ./weed)
  mv "$BUILD_TMP/weed" "$WEED.tmp"
  mv "$WEED.tmp" "$WEED"
  echo "built $WEED"
}

# port_busy succeeds if something listens on 127.0.0.1:$1.
port_busy() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# free_port prints a free TCP port on 127.0.0.1 not in the arguments. It
# picks below the kernel's ephemeral range: weed's own parts connect to each
# other before they all listen, and an outgoing connection's local port taken
# from that range can land on a port chosen here ("bind: address already in
# use").
free_port() {
  local p lo=32768 hi
  read -r lo hi </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true
  if [ "$lo" -le 12000 ]; then
    echo "seaweedfs: the ephemeral port range starts at $lo; no room below it" >&2
    return 1
  fi
  for _ in $(seq 1 200); do
    p=$((10000 + RANDOM % (lo - 10000)))
    case " $* " in *" $p "*) continue ;; esac
    if ! port_busy "$p"; then
      echo "$p"
      return 0
    fi
  done
  echo "seaweedfs: no free port found" >&2
  return 1
}

start() {
  local dir="$1" port="$2"
  if [ ! -x "$WEED" ]; then
    echo "seaweedfs: $WEED missing; run: $0 build" >&2
    exit 1
  fi
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  if [ -f "$dir/weed.pid" ] && kill -0 "$(cat "$dir/weed.pid")" 2>/dev/null; then
    echo "seaweedfs: already running with pid $(cat "$dir/weed.pid")" >&2
    exit 1
  fi
  if port_busy "$port"; then
    echo "seaweedfs: 127.0.0.1:$port is already in use" >&2
    exit 1
  fi
  # A port can still be taken between the check and weed's bind; then weed
  # exits saying so, and a second try with new ports is the cure.
  local attempt rc
  for attempt in 1 2 3; do
    rc=0
    launch "$dir" "$port" || rc=$?
    case "$rc" in
      0) return 0 ;;
      2) echo "seaweedfs: a port was taken as weed started (try $attempt of 3); picking new ports" >&2
         rm -f "$dir/weed.ports" ;;
      *) exit 1 ;;
    esac
  done
  echo "seaweedfs: weed could not bind its ports in 3 tries" >&2
  exit 1
}

# launch runs weed once and waits for its S3 gateway. It returns 0 when S3
# answers, 2 when weed exited because a port was in use, 1 on any other
# failure.
launch() {
  local dir="$1" port="$2"
  # Every gRPC port is its HTTP port + 10000 unless set; pick all of them
  # explicitly so several servers (and other services) never collide. The
  # master keeps its state in a directory named after its port, so a restart
  # reuses the ports of the first start while they are free.
  local mp="" vp fp mg vg fg sg p
  if [ -f "$dir/weed.ports" ]; then
    read -r mp vp fp mg vg fg sg <"$dir/weed.ports" || true
    for p in $mp $vp $fp $mg $vg $fg $sg; do
      if [ "$p" = "$port" ] || port_busy "$p"; then
        mp=""
      fi
    done
  fi
  if [ -z "$mp" ] || [ -z "${sg:-}" ]; then
    local used="$port"
    mp="$(free_port $used)" || return 1; used="$used $mp"
    vp="$(free_port $used)" || return 1; used="$used $vp"
    fp="$(free_port $used)" || return 1; used="$used $fp"
    mg="$(free_port $used)" || return 1; used="$used $mg"
    vg="$(free_port $used)" || return 1; used="$used $vg"
    fg="$(free_port $used)" || return 1; used="$used $fg"
    sg="$(free_port $used)" || return 1
    echo "$mp $vp $fp $mg $vg $fg $sg" >"$dir/weed.ports"
  fi
  # Each bucket takes several volumes of up to 256 MiB (sparse files), so
  # allow many: the default of 8 runs out at the second bucket. A master that
  # was killed before saving its state would otherwise refuse to grow volumes
  # after a restart ("volume growth is frozen"); this server is disposable.
  WEED_MASTER_VOLUME_GROWTH_FREEZE_ON_TOPOLOGY_MISMATCH=false \
  nohup "$WEED" server \
    -dir="$dir" \
    -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.port="$mp" -master.port.grpc="$mg" \
    -volume.port="$vp" -volume.port.grpc="$vg" \
    -filer.port="$fp" -filer.port.grpc="$fg" \
    -s3 -s3.port="$port" -s3.port.grpc="$sg" \
    -s3.port.iceberg=0 -s3.port.lance=0 \
    -master.telemetry=false -master.volumeSizeLimitMB=256 -volume.max=100 \
    >"$dir/weed.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$dir/weed.pid"
  local i
  for i in $(seq 1 60); do
    if ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$dir/weed.pid"
      if grep -q "address already in use" "$dir/weed.log"; then
        grep "address already in use" "$dir/weed.log" | head -n 3 >&2
        return 2
      fi
      echo "seaweedfs: weed exited; last log lines:" >&2
      tail -n 30 "$dir/weed.log" >&2 || true
      return 1
    fi
    if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$port/"; then
      echo "seaweedfs: S3 on 127.0.0.1:$port (pid $pid, log $dir/weed.log)"
      return 0
    fi
    sleep 1
  done
  echo "seaweedfs: S3 did not answer on 127.0.0.1:$port within 60 s; last log lines:" >&2
  tail -n 30 "$dir/weed.log" >&2 || true
  kill "$pid" 2>/dev/null || true
  rm -f "$dir/weed.pid"
  return 1
}

stop() {
  local dir="$1" pid
  if [ ! -f "$dir/weed.pid" ]; then
    echo "seaweedfs: no $dir/weed.pid" >&2
    exit 1
  fi
  pid="$(cat "$dir/weed.pid")"
  if kill "$pid" 2>/dev/null; then
    local i
    for i in $(seq 1 20); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$dir/weed.pid"
  echo "seaweedfs: stopped pid $pid"
}

case "${1:-}" in
  build) [ $# -eq 1 ] || usage; build ;;
  start) [ $# -eq 3 ] || usage; start "$2" "$3" ;;
  stop) [ $# -eq 2 ] || usage; stop "$2" ;;
  *) usage ;;
esac
