#!/usr/bin/env bash
# Start a cross-silo FedMITR run on this machine over GRPC (loopback): one server and N clients.
#
#   examples/cross_silo/run_local.sh N [SERVER_CONFIG] [CLIENT_CONFIG]
#
# Defaults: config/cross_silo/fedmitr_grpc_server.yaml and fedmitr_grpc_client.yaml. The configs
# are copied with worker_num / client_num_in_total / client_num_per_round set to N and a GRPC
# address table of N+1 loopback ports (from $FEDMITR_GRPC_BASE_PORT, default 8890). Logs go to
# $FEDMITR_LOG_DIR (default fedmitr_output/cross_silo_logs). Waits for the server, gives the
# clients $FEDMITR_CLIENT_GRACE_S seconds (default 60) to finish, kills what is left, and exits
# with the server's exit code (1 if the server succeeded but a client failed).
# Python: $PYTHON, else .venv/bin/python when present, else python3.
set -u
N="${1:?usage: run_local.sh N [SERVER_CONFIG] [CLIENT_CONFIG]}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
SERVER_CFG="$(realpath "${2:-config/cross_silo/fedmitr_grpc_server.yaml}")"
CLIENT_CFG="$(realpath "${3:-config/cross_silo/fedmitr_grpc_client.yaml}")"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
BASE_PORT="${FEDMITR_GRPC_BASE_PORT:-8890}"
LOG_DIR="${FEDMITR_LOG_DIR:-fedmitr_output/cross_silo_logs}"
GRACE="${FEDMITR_CLIENT_GRACE_S:-60}"
RUN_ID="${FEDMITR_RUN_ID:-$(date +%s)}"
mkdir -p "$LOG_DIR"
LOG_DIR="$(realpath "$LOG_DIR")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/fedmitr_cross_silo.XXXXXX")"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do
    kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null
  done
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# per-run configs: N clients and an address table of N+1 loopback ports
"$PYTHON" - "$N" "$BASE_PORT" "$WORK" "$SERVER_CFG" "$CLIENT_CFG" <<'PY' || exit 2
import sys, yaml
n, base, work, server_cfg, client_cfg = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
csv = f"{work}/grpc_ipconfig.csv"
with open(csv, "w") as fh:
    fh.write("eid,rank,grpc_server_ip,grpc_server_port\n")
    for rank in range(n + 1):
        fh.write(f"{rank},{rank},127.0.0.1,{base + rank}\n")
for src, dst in ((server_cfg, "server.yaml"), (client_cfg, "client.yaml")):
    cfg = yaml.safe_load(open(src))
    for section in cfg.values():
        if isinstance(section, dict):
            for key in ("worker_num", "client_num_in_total", "client_num_per_round"):
                if key in section:
                    section[key] = n
            if "grpc_ipconfig_path" in section:
                section["grpc_ipconfig_path"] = csv
    cfg.setdefault("device_args", {})["worker_num"] = n
    yaml.safe_dump(cfg, open(f"{work}/{dst}", "w"), sort_keys=False)
PY

start() {  # start in its own process group so cleanup can kill everything it spawns
  setsid "$PYTHON" -m fedml_fedmitr "$@" &
  PIDS+=("$!")
}

start --cf "$WORK/server.yaml" --rank 0 --role server --run_id "$RUN_ID" >"$LOG_DIR/server.log" 2>&1
SERVER_PID="${PIDS[0]}"
sleep "${FEDMITR_SERVER_HEADSTART_S:-2}"
for i in $(seq 1 "$N"); do
  start --cf "$WORK/client.yaml" --rank "$i" --role client --run_id "$RUN_ID" >"$LOG_DIR/client_$i.log" 2>&1
done
echo "run_local.sh: server pid $SERVER_PID, $N clients; logs in $LOG_DIR" >&2

wait "$SERVER_PID"
SERVER_RC=$?
echo "run_local.sh: server exited with $SERVER_RC" >&2
CLIENT_FAILED=0
deadline=$((SECONDS + GRACE))
for idx in $(seq 1 "$N"); do
  pid="${PIDS[$idx]}"
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "run_local.sh: client $idx still running after the server exited; killing it" >&2
    kill -- "-$pid" 2>/dev/null
    CLIENT_FAILED=1
  else
    wait "$pid"; rc=$?
    if [ "$rc" -ne 0 ]; then echo "run_local.sh: client $idx exited with $rc" >&2; CLIENT_FAILED=1; fi
  fi
done
if [ "$SERVER_RC" -eq 0 ] && [ "$CLIENT_FAILED" -ne 0 ]; then exit 1; fi
exit "$SERVER_RC"
