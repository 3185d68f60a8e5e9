#!/usr/bin/env bash
# A dsec cluster on this one machine: PostgreSQL (a throwaway cluster of
# Debian's server), SeaweedFS for the shared blob store, apiservers and
# edges as processes of their own with certificates from a cluster CA, each
# edge with its own root, ports, address pool, nftables table, veth prefix,
# NFLOG group and cgroup.
#
#   scripts/cluster.sh up [--demo] [--edges N] [--apiservers N] [--dir DIR]
#   scripts/cluster.sh up --hollow N [--max-sandboxes M]
#                                          N hollow edges in one process (they start
#                                          nothing): the control plane alone, for
#                                          `dsec bench cluster`
#   scripts/cluster.sh env [--dir DIR]     print the DSEC_ADDR and DSEC_TOKEN lines again
#   scripts/cluster.sh down [--dir DIR]    stop everything, remove every sandbox and DIR
#
# `up` prints lines a shell can eval to use the cluster:
#   eval "$(scripts/cluster.sh up)"; bin/dsec create -n 10 busybox:1
# With --demo it then runs the README's rollout demo against the cluster:
# the batch is spread over the edges. State lives in DIR (default
# /var/lib/dsec-cluster); `down` removes it.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export PATH="$PATH:/usr/local/go/bin:/usr/sbin:/sbin"

cmd=${1:-}
[ $# -gt 0 ] && shift
dir=/var/lib/dsec-cluster
edges=3
apiservers=2
demo=0
hollow=0
hollow_max=4000
while [ $# -gt 0 ]; do
  case "$1" in
    --hollow) hollow=$2; shift 2 ;;
    --max-sandboxes) hollow_max=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --edges) edges=$2; shift 2 ;;
    --apiservers) apiservers=$2; shift 2 ;;
    --demo) demo=1; shift ;;
    *) echo "cluster.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

say() { printf '%s\n' "$*" >&2; }
die() { say "cluster.sh: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "edges run containers and mount file systems; run as root"

pgbin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && { echo "$d"; return; }; done
  return 1
}

s3port=18433
apiport() { echo $((18700 + $1)); }
edgeport() { echo $((18600 + $1)); }
dsn() { echo "host=$dir/pgsock user=postgres dbname=dsec"; }
blobstore() { echo "s3://dsec-layers?endpoint=127.0.0.1:$s3port&insecure=1"; }

# The flags that make edge i a node of its own on this host; teardown takes
# the same ones, so it finds what the edge made.
edge_node_flags() {
  local i=$1
  echo --node "e$i" --root "$dir/e$i" --network-pool "10.$((213 + i)).0.0/16" --nft-table "dsec_e$i" \
    --veth-prefix "e${i}v" --nflog-group $((2130 + i)) --cgroup-parent "dsec-e$i" --blob-store "$(blobstore)"
}

start_bg() { # NAME LOG CMD...
  local name=$1 log=$2
  shift 2
  nohup "$@" >>"$log" 2>&1 &
  echo $! >"$dir/$name.pid"
}

stop_pid() { # NAME
  local f="$dir/$1.pid" pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

print_env() {
  local addrs="" i
  [ -f "$dir/apiservers" ] && apiservers=$(cat "$dir/apiservers")
  for i in $(seq "$apiservers"); do addrs="${addrs:+$addrs,}127.0.0.1:$(apiport "$i")"; done
  echo "export DSEC_ADDR=$addrs"
  echo "export DSEC_TOKEN=$(cat "$dir/token")"
}

up() {
  if [ -f "$dir/token" ]; then
    say "a cluster runs in $dir already (scripts/cluster.sh down --dir $dir first)"
    print_env
    return
  fi
  say "== packages"
  local need=()
  for c in runc mkfs.erofs busybox bash-static mkfs.btrfs nft ip tar python3; do
    command -v "$c" >/dev/null 2>&1 || need+=("$c")
  done
  pgbin >/dev/null || need+=(postgresql)
  if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends runc erofs-utils busybox-static bash-static btrfs-progs \
      e2fsprogs nftables iproute2 tar python3 postgresql ca-certificates >/dev/null
  fi
  say "== building dsec"
  make -s build
  mkdir -p "$dir"
  chmod 711 "$dir"

  say "== PostgreSQL"
  local pg
  pg=$(pgbin) || die "PostgreSQL is not installed"
  mkdir -p "$dir/pg" "$dir/pgsock"
  chown postgres "$dir/pg" "$dir/pgsock"
  runuser -u postgres -- "$pg/initdb" -D "$dir/pg" -A trust -U postgres >/dev/null
  runuser -u postgres -- "$pg/pg_ctl" -D "$dir/pg" -l "$dir/pgsock/pg.log" -w \
    -o "-k $dir/pgsock -c listen_addresses=''" start >/dev/null
  runuser -u postgres -- "$pg/createdb" -h "$dir/pgsock" dsec

  if [ "$hollow" -eq 0 ]; then
    say "== SeaweedFS (the shared blob store)"
    scripts/seaweedfs.sh build >&2
    scripts/seaweedfs.sh start "$dir/weed" "$s3port" >&2
  fi

  say "== certificates"
  local args=(init-cluster --dir "$dir/pki") i
  for i in $(seq "$apiservers"); do args+=(--apiserver "api$i"); done
  if [ "$hollow" -gt 0 ]; then
    edges=$hollow
    for i in $(seq "$hollow"); do args+=(--edge "h$i=127.0.0.1"); done
  else
    for i in $(seq "$edges"); do args+=(--edge "e$i=127.0.0.1"); done
  fi
  bin/dsecd "${args[@]}"

  if [ "$hollow" -gt 0 ]; then
    say "== $hollow hollow edges, in one process"
    start_bg fleet "$dir/fleet.log" bin/dsecd hollow-fleet --count "$hollow" --tls-dir "$dir/pki" \
      --registry "$(dsn)" --max-sandboxes "$hollow_max"
  else
    say "== $edges edges"
    for i in $(seq "$edges"); do
      # shellcheck disable=SC2046
      start_bg "e$i" "$dir/e$i.log" bin/dsecd edge $(edge_node_flags "$i") \
        --listen "127.0.0.1:$(edgeport "$i")" --tls-dir "$dir/pki" --registry "$(dsn)"
    done
  fi
  say "== $apiservers apiservers"
  for i in $(seq "$apiservers"); do
    start_bg "api$i" "$dir/api$i.log" bin/dsecd apiserver --name "api$i" --listen "127.0.0.1:$(apiport "$i")" \
      --tls-dir "$dir/pki" --db "$(dsn)" --replicas "$apiservers"
  done
  bin/dsecd token --db "$(dsn)" --principal admin >"$dir/token"
  chmod 600 "$dir/token"

  eval "$(print_env)"
  for _ in $(seq 600); do
    local routed=0
    for i in $(seq "$apiservers"); do
      # It may log its routes before it listens; "apiserver ready" follows.
      [ "$(grep -c 'msg="node routable"' "$dir/api$i.log" 2>/dev/null || true)" -ge "$edges" ] &&
        grep -q 'msg="apiserver ready"' "$dir/api$i.log" && routed=$((routed + 1))
    done
    [ "$routed" -eq "$apiservers" ] && break
    sleep 0.1
  done
  bin/dsec ls >/dev/null || { tail -5 "$dir"/*.log >&2; die "the cluster does not answer"; }
  echo "$apiservers" >"$dir/apiservers"
  say "cluster up: $apiservers apiservers, $edges edges, state in $dir"
  print_env
  if [ "$demo" -eq 1 ]; then
    say "== the rollout demo, against the cluster"
    scripts/demo.sh >&2
  fi
}

down() {
  [ -d "$dir" ] || { say "no cluster in $dir"; return; }
  local i
  for f in "$dir"/api*.pid; do [ -e "$f" ] && stop_pid "$(basename "$f" .pid)"; done
  stop_pid fleet
  for i in $(seq 64); do
    [ -d "$dir/e$i" ] || continue
    stop_pid "e$i"
    # shellcheck disable=SC2046
    bin/dsecd teardown $(edge_node_flags "$i") >&2 || say "teardown of e$i failed"
  done
  [ -d "$dir/weed" ] && scripts/seaweedfs.sh stop "$dir/weed" >&2 || true
  local pg
  if pg=$(pgbin) && [ -f "$dir/pg/postmaster.pid" ]; then
    runuser -u postgres -- "$pg/pg_ctl" -D "$dir/pg" -m fast -w stop >/dev/null || true
  fi
  rm -rf "$dir"
  say "cluster down"
}

case "$cmd" in
  up) up ;;
  down) down ;;
  env) [ -f "$dir/token" ] || die "no cluster in $dir"; print_env ;;
  *) echo "usage: $0 up [--demo] [--edges N] [--apiservers N] [--dir DIR] | env [--dir DIR] | down [--dir DIR]" >&2; exit 2 ;;
esac
