#!/usr/bin/env bash
# What recording trajectories and provenance adds to the demo's wall time:
# the README demo's coding batch (demo/rollout.py, containers, warm pool,
# clean-room grades; no preemption, no systems batch) run in turns against
# one dsecd with recording on (the default) and off (--no-trajectories
# --no-provenance), restarted between runs on the same root (the order
# swapped each round), then the ratio
# of the runs' wall times, on/off (target <= 1.03), as the median of the
# rounds' ratios with their range.
#
#   scripts/bench-recording.sh [-r ROUNDS] [-n ROLLOUTS] [-o "OFF FLAGS"]
#
# -o gives the off side's dsecd flags instead (e.g. --no-provenance alone,
# to see what one of the two costs).
#
# As root, after `make build`, with the demo's Debian base tree built
# (scripts/demo.sh once: /var/cache/dsec/demo-debian, or
# DSEC_DEMO_BASE_TREE). Its dsecd runs on a root of its own under $TMPDIR,
# torn down at the end, failure or not.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rounds=3 n=16 offflags="--no-trajectories --no-provenance"
while getopts r:n:o: o; do
  case $o in
    r) rounds=$OPTARG ;;
    n) n=$OPTARG ;;
    o) offflags=$OPTARG ;;
    *) echo "usage: $0 [-r ROUNDS] [-n ROLLOUTS] [-o \"OFF FLAGS\"]" >&2; exit 2 ;;
  esac
done
tree=${DSEC_DEMO_BASE_TREE:-/var/cache/dsec/demo-debian}
[ -f "$tree/etc/dsec-demo-debian" ] || { echo "bench-recording: no demo base tree at $tree (run scripts/demo.sh once)" >&2; exit 1; }
[ -x bin/dsecd ] || { echo "bench-recording: no bin/dsecd (make build)" >&2; exit 1; }

root=$(mktemp -d -t dsec-bench-recording.XXXXXX)
export DSEC_ADDR=unix://$root/dsecd.sock DSEC_TOKEN_FILE=$root/admin.token
pid=
start() {
  bin/dsecd --root "$root" "$@" >>"$root/dsecd.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do bin/dsec ls >/dev/null 2>&1 && return 0; sleep 0.1; done
  tail -20 "$root/dsecd.log" >&2
  return 1
}
stop() {
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=
  fi
}
cleanup() {
  stop
  bin/dsecd teardown --root "$root" >/dev/null 2>&1 || true
  rm -rf "$root"
}
trap cleanup EXIT

start
bin/dsec layer import --kind base --allow-setuid demo-debian:2 "$tree" >/dev/null
bin/dsec layer import --kind workspace demo-textstats:1 "$repo/demo/workspace" >/dev/null
bin/dsec layer import --kind toolkit demo-harness:1 "$repo/demo/toolkit" >/dev/null
stop

batch() {
  local t0 t1
  t0=$(date +%s.%N)
  PYTHONPATH="$repo/sdk/python${PYTHONPATH:+:$PYTHONPATH}" \
    python3 demo/rollout.py --env demo-debian:2+demo-textstats:1+demo-harness:1 -n "$n" --no-preempt \
    >"$root/batch.out" 2>&1 || { tail -20 "$root/batch.out" >&2; return 1; }
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.3f", b - a }'
}

ratios=()
echo "off: dsecd $offflags"
printf '%-6s %10s %10s %8s\n' round "on (s)" "off (s)" "on/off"
run_on() { start; on=$(batch); stop; }
# shellcheck disable=SC2086 # the flags are words
run_off() { start $offflags; off=$(batch); stop; }
for r in $(seq "$rounds"); do
  # Odd rounds run recording on first, even rounds off first.
  if [ $((r % 2)) -eq 1 ]; then run_on; run_off; else run_off; run_on; fi
  ratio=$(awk -v a="$on" -v b="$off" 'BEGIN { printf "%.4f", a / b }')
  ratios+=("$ratio")
  printf '%-6s %10.2f %10.2f %8.3f\n' "$r" "$on" "$off" "$ratio"
done
printf '%s\n' "${ratios[@]}" | sort -n | awk -v n="$n" '
  { v[NR] = $1 }
  END {
    med = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
    printf "wall time on/off, median of %d rounds: %.3fx (range %.3f-%.3f; %d rollouts a run; target <= 1.03x: %s)\n",
      NR, med, v[1], v[NR], n, (med <= 1.03) ? "met" : "MISSED"
  }'
