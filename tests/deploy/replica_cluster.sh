# Helpers shared by the replica tests (tests/deploy/*_test.sh): a model, sdm-server replicas
# on loopback sharing one --state_dir, and nginx in front of them with deploy/nginx/nginx.conf
# unchanged. Source it after setting BUILD_DIR and SOURCE_DIR, then call cluster_test_begin.
# Every process started here is recorded in $work/pids and killed by cluster_cleanup.

server_bin="$BUILD_DIR/server/sdm-server"
client_bin="$BUILD_DIR/client/sdm-client"
model_bin="$BUILD_DIR/tools/sdm_model/sdm-model"

fail() { echo "FAIL: $*"; exit 1; }

# cluster_test_begin [COMMAND...]: the start of every replica test. /usr/sbin and /sbin on PATH
# (Debian installs nginx there, which a non-root user's PATH lacks: the test would skip); exit
# 77 (skipped, saying so) when a COMMAND is not installed; $work a new temporary directory; and at
# exit, whatever the outcome: cluster_test_on_exit STATUS if the test defines it, then
# cluster_cleanup, then $work removed (kept, and named, with SDM_KEEP_WORK set).
cluster_test_begin() {
  export PATH="$PATH:/usr/sbin:/sbin"
  local command
  for command in "$@"; do
    command -v "$command" >/dev/null || { echo "skip: $command is not installed"; exit 77; }
  done
  work=$(mktemp -d)
  trap 'cluster_test_end $?' EXIT
}

cluster_test_end() {
  if declare -F cluster_test_on_exit >/dev/null; then cluster_test_on_exit "$1" || true; fi
  cluster_cleanup
  if [ -n "${SDM_KEEP_WORK:-}" ]; then echo "kept $work"; else rm -rf "$work"; fi
}

cluster_cleanup() {
  if [ -f "$work/pids" ]; then
    while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done <"$work/pids"
  fi
  if [ -f "$work/nginx/nginx.pid" ]; then kill "$(cat "$work/nginx/nginx.pid")" 2>/dev/null || true; fi
}

# A free loopback TCP port, bound and released for etcd or nginx to bind later. Port 0 would
# come from the ephemeral range, from which every outgoing connection takes its local port too
# (this test makes hundreds): one could take it before etcd binds it. So a random port below that
# range, checked free, is used; only another test's pick of the same port can collide now.
free_port() {
  python3 - <<'PY'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for _ in range(100):
    port = random.randint(10000, low - 1) if low > 10001 else 0
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    break
else:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])
PY
}

make_model() {
  "$model_bin" init --preset "${SDM_PRESET:-tiny}" --seed 1 --out "$work/model" --force >"$work/sdm-model.log" 2>&1 ||
    { cat "$work/sdm-model.log"; fail "sdm-model init"; }
}

# http_port_of FILE: the port of the "OpenAI-compatible HTTP API on http://HOST:PORT/v1" line
# sdm-server prints with --http_port (empty until it did).
http_port_of() {
  sed -n 's|^OpenAI-compatible HTTP API on http://[^ ]*:\([0-9]*\)/v1 .*|\1|p' "$1" | head -1
}

# start_replica NAME [extra flags...]: starts sdm-server on a free port; sets REPLICA_PORT, and
# with --http_port among the flags REPLICA_HTTP_PORT (the HTTP API's port).
start_replica() {
  local name=$1; shift
  local want_http=""
  [[ " $* " == *" --http_port"[\ =]* ]] && want_http=1
  "$server_bin" --model "$work/model" --host 127.0.0.1 --port 0 --metrics_port -1 --threads 1 \
    --state_dir "$work/state" --shared_state_dir "$@" >"$work/$name.out" 2>"$work/$name.err" &
  echo $! >>"$work/pids"; disown
  echo $! >"$work/$name.pid"
  for _ in $(seq 1 600); do
    if grep -q "^listening on" "$work/$name.out" && { [ -z "$want_http" ] || [ -n "$(http_port_of "$work/$name.out")" ]; }; then
      REPLICA_PORT=$(sed -n 's/^listening on [^ ]*:\([0-9]*\) .*/\1/p' "$work/$name.out" | head -1)
      echo "$REPLICA_PORT" >"$work/$name.port"
      REPLICA_HTTP_PORT=$(http_port_of "$work/$name.out")
      return 0
    fi
    kill -0 "$(cat "$work/$name.pid")" 2>/dev/null || { cat "$work/$name.err"; fail "$name exited"; }
    sleep 0.1
  done
  cat "$work/$name.err"; fail "$name did not start"
}

# start_nginx PORT REPLICA_PORT...: nginx on 127.0.0.1:PORT with the deployed configuration.
# Its HTTP front: set NGINX_HTTP_PORT and REPLICA_HTTP_PORTS (the replicas' HTTP ports, space
# separated) first; without them it listens on a free port in front of no replica (one server
# marked down: nginx refuses an empty upstream).
start_nginx() {
  local port=$1; shift
  mkdir -p "$work/nginx/conf" "$work/nginx/logs" "$work/nginx/tmp"
  cp "$SOURCE_DIR/deploy/nginx/nginx.conf" "$work/nginx/conf/nginx.conf"
  echo "listen 127.0.0.1:$port http2;" >"$work/nginx/conf/sdm-listen.conf"
  : >"$work/nginx/conf/sdm-upstreams.conf"
  for p in "$@"; do
    echo "server 127.0.0.1:$p max_fails=1 fail_timeout=5s;" >>"$work/nginx/conf/sdm-upstreams.conf"
  done
  echo "listen 127.0.0.1:${NGINX_HTTP_PORT:-$(free_port)};" >"$work/nginx/conf/sdm-http-listen.conf"
  if [ -n "${REPLICA_HTTP_PORTS:-}" ]; then
    : >"$work/nginx/conf/sdm-http-upstreams.conf"
    for p in $REPLICA_HTTP_PORTS; do
      echo "server 127.0.0.1:$p max_fails=1 fail_timeout=5s;" >>"$work/nginx/conf/sdm-http-upstreams.conf"
    done
  else
    echo "server 127.0.0.1:9 down;" >"$work/nginx/conf/sdm-http-upstreams.conf"
  fi
  nginx -p "$work/nginx" -c conf/nginx.conf -e "$work/nginx/logs/error.log" ||
    { cat "$work/nginx/logs/error.log"; fail "nginx did not start"; }
  for _ in $(seq 1 600); do
    [ -s "$work/nginx/nginx.pid" ] && return 0
    sleep 0.1
  done
  fail "nginx wrote no pid file"
}

# start_etcd: etcd on free loopback ports with a data directory under $work; sets ETCD_URL.
start_etcd() {
  local client peer
  client=$(free_port)
  peer=$(free_port)
  ETCD_URL="http://127.0.0.1:$client"
  etcd --data-dir "$work/etcd" --listen-client-urls "$ETCD_URL" --advertise-client-urls "$ETCD_URL" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "default=http://127.0.0.1:$peer" >"$work/etcd.log" 2>&1 &
  echo $! >>"$work/pids"; disown
  for _ in $(seq 1 600); do
    curl -sf -X POST "$ETCD_URL/v3/kv/range" -d '{"key":"AA=="}' >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  cat "$work/etcd.log"; fail "etcd did not start"
}

# start_etcd_cluster N: an etcd cluster of N members (m0 .. m(N-1)) on free loopback ports, data
# under $work; sets ETCD_URLS (every member's client URL, comma-separated, as --etcd takes them)
# and ETCD_MEMBER_URLS (an array); member i's pid is in $work/etcd-mi.pid. Returns once every
# member answers a linearizable read (the cluster has a leader).
start_etcd_cluster() {
  local n=$1 i cluster="" url
  local -a peers=() clients=()
  for i in $(seq 0 $((n - 1))); do
    peers+=("http://127.0.0.1:$(free_port)")
    clients+=("http://127.0.0.1:$(free_port)")
    cluster+="${cluster:+,}m$i=${peers[$i]}"
  done
  for i in $(seq 0 $((n - 1))); do
    etcd --name "m$i" --data-dir "$work/etcd-m$i" \
      --listen-client-urls "${clients[$i]}" --advertise-client-urls "${clients[$i]}" \
      --listen-peer-urls "${peers[$i]}" --initial-advertise-peer-urls "${peers[$i]}" \
      --initial-cluster "$cluster" --initial-cluster-state new \
      --initial-cluster-token "sdm-test-$$" >"$work/etcd-m$i.log" 2>&1 &
    echo $! >>"$work/pids"
    echo $! >"$work/etcd-m$i.pid"
    disown
  done
  ETCD_MEMBER_URLS=("${clients[@]}")
  ETCD_URLS=$(IFS=,; echo "${clients[*]}")
  for url in "${clients[@]}"; do
    wait_for "etcd member $url" 120 curl -sf -X POST "$url/v3/kv/range" -d '{"key":"AA=="}' -o /dev/null
  done
}

# etcd_leader_index: the index in ETCD_MEMBER_URLS of the member that is the leader now (by
# its own status: its member id equals the leader it names); empty if none answers so.
etcd_leader_index() {
  local i status
  for i in "${!ETCD_MEMBER_URLS[@]}"; do
    status=$(curl -sf -X POST "${ETCD_MEMBER_URLS[$i]}/v3/maintenance/status" -d '{}' 2>/dev/null) || continue
    if [ -n "$status" ] && [ "$(jq -r '.header.member_id' <<<"$status")" = "$(jq -r '.leader' <<<"$status")" ]; then
      echo "$i"
      return 0
    fi
  done
}

# start_control [extra flags...]: a server alone (its own --state_dir, no etcd): the reference
# the replicas' turns must equal. Sets CONTROL_PORT, and with --http_port CONTROL_HTTP_PORT.
start_control() {
  local want_http=""
  [[ " $* " == *" --http_port"[\ =]* ]] && want_http=1
  "$server_bin" --model "$work/model" --host 127.0.0.1 --port 0 --metrics_port -1 --threads 1 \
    --state_dir "$work/control_state" "$@" >"$work/control.out" 2>"$work/control.err" &
  echo $! >>"$work/pids"; disown
  for _ in $(seq 1 600); do
    grep -q "^listening on" "$work/control.out" &&
      { [ -z "$want_http" ] || [ -n "$(http_port_of "$work/control.out")" ]; } && break
    sleep 0.1
  done
  CONTROL_PORT=$(sed -n 's/^listening on [^ ]*:\([0-9]*\) .*/\1/p' "$work/control.out" | head -1)
  [ -n "$CONTROL_PORT" ] || fail "control server did not start"
  CONTROL_HTTP_PORT=$(http_port_of "$work/control.out")
  [ -z "$want_http" ] || [ -n "$CONTROL_HTTP_PORT" ] || fail "control server's HTTP API did not start"
}

# stop_replica NAME SIGNAL: sends SIGNAL and waits (up to 120 s) until the process is gone.
stop_replica() {
  local pid
  pid=$(cat "$work/$1.pid")
  kill "-$2" "$pid"
  wait_for "$1 to exit" 120 not_running "$pid"
}

not_running() { ! kill -0 "$1" 2>/dev/null; }

# wait_for WHAT SECONDS CMD...: runs CMD every 0.1 s until it succeeds; fails the test naming
# WHAT after SECONDS (a bound for a broken run, never an assertion on timing).
wait_for() {
  local what=$1 seconds=$2
  shift 2
  local deadline=$(($(date +%s) + seconds))
  until "$@"; do
    [ "$(date +%s)" -lt $deadline ] || fail "gave up waiting ${seconds}s for $what"
    sleep 0.1
  done
}

# retry CMD...: runs CMD until it succeeds, for up to 120 s (a lease TTL or an etcd election, and
# margin for a loaded machine); each retry is counted as a line of $work/retries (CMD may run in
# a subshell).
retry() {
  local deadline=$(($(date +%s) + 120))
  until "$@"; do
    [ "$(date +%s)" -lt $deadline ] || return 1
    echo >>"$work/retries"
    sleep 0.2
  done
}

# turn HOST SESSION K: one greedy turn; prints its token ids. Returns 1 on a failure to retry (a
# failed call prints its JSON too, which a retry must not collect); a turn that ran but was not
# saved (turn_in_session "yes") is done, counted as a line of $work/ran_unsaved.
turn() {
  local out rc=0
  out=$("$client_bin" generate --host "$1" --session "$2" --prompt "turn $3 of $2" \
    --max_tokens 4 --json 2>>"$work/client.err") || rc=$?
  if [ $rc -eq 0 ]; then
    jq -c '.token_ids' <<<"$out"
    return 0
  fi
  if [ "$(jq -r '.error.turn_in_session // empty' <<<"$out" 2>/dev/null)" = yes ]; then
    echo >>"$work/ran_unsaved"  # (a subshell: counted in a file)
    jq -c '.token_ids' <<<"$out"
    return 0
  fi
  return 1
}
# ran_unsaved: how many turns so far ran but were reported unsaved (turn).
ran_unsaved() { { wc -l <"$work/ran_unsaved"; } 2>/dev/null || echo 0; }

# position HOST SESSION: the session's position as sdm-client reads it (0 when it has none).
position() {
  "$client_bin" sessions get "$2" --host "$1" --json 2>>"$work/client.err" | jq -r '.position // 0'
}

# etcd_get KEY: the value of KEY in etcd (empty when absent), through its JSON gateway.
etcd_get() {
  local b64
  b64=$(printf '%s' "$1" | base64 -w0)
  curl -sf -X POST "$ETCD_URL/v3/kv/range" -d "{\"key\":\"$b64\"}" |
    jq -r '.kvs[0].value // empty' | base64 -d
}

key_absent() { [ -z "$(etcd_get "$1")" ]; }
