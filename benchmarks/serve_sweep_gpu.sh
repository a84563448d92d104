#!/usr/bin/env bash
# dscale-serve on the demo pair, measured by dscale-bench, as users run it (issues 24 and 25): one server per
# configuration below, each swept by dscale-bench --url over concurrency 1, 8, 32 at three sampling points
# (greedy; T = 1; T = 0.7 / top_p 0.8), one pass of >= MIN_S seconds per point after 8 warm-up requests.
# Server flags in CONFIGS reach dscale-serve as written (e.g. --switch-interval-ms 5 for CPython's default).
# Usage: bash benchmarks/serve_sweep_gpu.sh OUT_DIR [DEVICE]   (env: CONFIGS, POINTS, CONCURRENCY, MIN_S, ROUNDS, PIN,
# PAIRED: 1 = the servers compared pass by pass, benchmarks/serve_paired.py, OUT_DIR/paired.json, pinned servers
# rotating over their core sets round by round (ROUNDS a multiple of the server count shares them equally); NUM_REQUESTS:
# its requests per pass at least, default 64; STAGGER: 1 (default) = each server starts once the one before is up;
# CLIENT_PROCESSES: the bench client's processes, default 1: dscale-bench / serve_paired.py --client-processes)
# Writes OUT_DIR/<config>/<point>/bench.{json,csv} (<point>.r<round> with ROUNDS > 1) and server logs; then prints
# one table of every point, the median over the rounds with their spread (benchmarks/serve_sweep_summary.py, also
# written to OUT_DIR/summary.json).
set -uo pipefail
out=${1:?usage: bash benchmarks/serve_sweep_gpu.sh OUT_DIR [DEVICE]}
device=${2:-cuda}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
concurrency=${CONCURRENCY:-1,8,32}
min_s=${MIN_S:-5}
# name:server flags (the mode included); the flags are dscale-serve's
configs=${CONFIGS:-"target:--mode target;dflash:--mode dflash;dscale:--mode dscale;dscale-live:--mode dscale --dscale-policy live --target-fallback true"}
# name:bench sampling flags
points=${POINTS:-"greedy:--temperature 0;t1:--temperature 1;t07p08:--temperature 0.7 --top-p 0.8"}
running=$(tr ',' '\n' <<<"$concurrency" | sort -n | tail -1)
IFS=';' read -ra config_list <<<"$configs"
IFS=';' read -ra point_list <<<"$points"
# PIN=1 (the default where `taskset` exists): each server gets its own CPU cores and the bench client the rest, so a
# pass never shares a core with another process of the sweep (a whole 3-s pass ran 25-40% slower than the same
# point's other round on 2026-12-04, request by request, with the cores shared).
cores=$(nproc)
pin=${PIN:-1}
command -v taskset >/dev/null || pin=0
per_server=$(( cores / (${#config_list[@]} + 1) ))
[ "$per_server" -lt 1 ] && pin=0
pin_cmd() {  # pin_cmd INDEX: the `taskset` prefix of server INDEX's cores (INDEX = number of servers: the bench
  # client's); empty with pinning off. Used unquoted, so that a backgrounded server's $! is its own process.
  [ "$pin" = 1 ] || return 0
  local first=$(( $1 * per_server )) last=$(( $1 == ${#config_list[@]} ? cores - 1 : ($1 + 1) * per_server - 1 ))
  echo "taskset -c $first-$last"
}
echo "[sweep] $cores CPU cores, pinning $([ "$pin" = 1 ] && echo "on: $per_server per server" || echo off)"
# Servers start one after another (STAGGER=1, the default): each one's start-up times its steps and prefill buckets
# (the measured policy, the decode steps and prefill buckets behind the chunk budget) with the GPU to itself, as a
# server alone on a GPU does; timed beside another server's capture they read long and stay so for the server's life.
# STAGGER=0 starts them all at once (quicker). Once all are up, one bench runs at a time while the others wait idle;
# all stop at the end. Each server's start-up timings go to OUT_DIR/startup.txt.
declare -A ports pids starts up
wait_up() {  # wait_up NAME: until the server answers /health (returns 1 if it died first)
  local name=$1 port=${ports[$1]} pid=${pids[$1]}
  until python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$port/health', timeout=5).status_code != 200)" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "server $name exited:"; tail -30 "$out/$name/server.log"; return 1; fi
    sleep 0.5
  done
  up[$name]=1
  echo "[sweep] $name up $(python -c "print(round($(date +%s.%N) - ${starts[$name]}, 1))") s after its start"
}
stagger=${STAGGER:-1}
index=0
for entry in "${config_list[@]}"; do
  name=${entry%%:*} flags=${entry#*:}
  ports[$name]=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  mkdir -p "$out/$name"
  # shellcheck disable=SC2086
  $(pin_cmd "$index") python -m dscale_runtime.server.main $flags --device "$device" --port "${ports[$name]}" \
    --max-running-requests "$running" --log-level info >"$out/$name/server.log" 2>&1 &
  index=$((index + 1))
  pids[$name]=$! starts[$name]=$(date +%s.%N)
  [ "$stagger" = 1 ] && wait_up "$name"
done
if [ "$stagger" != 1 ]; then  # every server up (or dead) before any is measured: no start-up beside a sweep
  for entry in "${config_list[@]}"; do
    wait_up "${entry%%:*}"
  done
fi
for entry in "${config_list[@]}"; do
  name=${entry%%:*}
  echo "== $name (${entry#*:})"
  grep -E "KV cache:|DScale policy|prefill ms per token bucket|decode ms per bucket" "$out/$name/server.log" | cut -c1-2000
done >"$out/startup.txt"
# Rounds interleave the servers: each point is measured on every server before the next point, and each round
# starts one server later, so a drift of the machine over the run falls on every server alike.
rounds=${ROUNDS:-1}
names=()
for entry in "${config_list[@]}"; do
  name=${entry%%:*}
  [ -n "${up[$name]:-}" ] && names+=("$name")
done
if [ "${PAIRED:-0}" = 1 ]; then
  # PAIRED=1: benchmarks/serve_paired.py instead of one dscale-bench per server: every server runs one pass of
  # >= MIN_S seconds in turn at each point and concurrency, ROUNDS rounds, and the ratios are taken per round
  urls=$(for name in "${names[@]}"; do printf '%s=http://127.0.0.1:%s,' "$name" "${ports[$name]}"; done)
  # Pinned, the servers also trade their core sets round by round (serve_paired.py --core-sets), so that what a core
  # set costs (a busy sibling hyperthread, interrupts) falls on every server alike, not on the one started there.
  rotate=()
  if [ "$pin" = 1 ]; then
    sets=$(for ((i = 0; i < ${#config_list[@]}; i++)); do pin_cmd "$i" | awk '{printf "%s;", $3}'; done)
    pid_list=$(for name in "${names[@]}"; do printf '%s=%s,' "$name" "${pids[$name]}"; done)
    rotate=(--pids "${pid_list%,}" --core-sets "${sets%;}")
  fi
  # shellcheck disable=SC2046
  $(pin_cmd "${#config_list[@]}") python benchmarks/serve_paired.py --servers "${urls%,}" --points "$points" \
    --concurrency "$concurrency" --rounds "$rounds" --pass-s "$min_s" --num-requests "${NUM_REQUESTS:-64}" \
    --client-processes "${CLIENT_PROCESSES:-1}" ${rotate[@]+"${rotate[@]}"} --out "$out/paired.json"
  rounds=0
fi
for ((r = 1; r <= rounds; r++)); do
  for p in "${point_list[@]}"; do
    pname=${p%%:*} pflags=${p#*:}
    dir=$pname
    [ "$rounds" -gt 1 ] && dir="$pname.r$r"
    for ((i = 0; i < ${#names[@]}; i++)); do
      name=${names[$(((i + r - 1) % ${#names[@]}))]}
      port=${ports[$name]}
      # shellcheck disable=SC2086
      $(pin_cmd "${#config_list[@]}") python -m dscale_runtime.bench --url "http://127.0.0.1:$port" \
        --concurrency "$concurrency" --num-requests 64 --client-processes "${CLIENT_PROCESSES:-1}" \
        --warmup 8 --repetitions 1 --min-duration-s "$min_s" --max-tokens 64 $pflags \
        --output "$out/$name/$dir" 2>&1 | grep -E "^\[dscale-bench\].*pass|Error|error" | sed "s/^/[$name $dir] /"
    done
  done
done
for name in "${names[@]}"; do
  port=${ports[$name]} pid=${pids[$name]}
  python -c "import httpx; print(httpx.get('http://127.0.0.1:$port/metrics', timeout=30).text)" >"$out/$name/metrics.txt"
  kill "$pid"; wait "$pid" 2>/dev/null
done
[ "${PAIRED:-0}" = 1 ] || python benchmarks/serve_sweep_summary.py "$out"
