#!/usr/bin/env bash
# Tries scripts/e2e.d/upgrade-load.py against the local playground (scripts/dev up), in a
# namespace of its own: a ServiceAccount with the Roles the load needs, two RunSessions to
# enqueue for, a token with the audience prism-operator; then the load for SECONDS, and
# its summary. With RESTART_AT (seconds), RESTART_CMD runs then (default: SIGTERM the
# playground's operator and `scripts/dev up` again, which rebuilds first when the code
# changed) — the load should then show retried or failed calls and resumed streams.
#
#   source .dev/env && scripts/e2e.d/upgrade-load-selftest.sh
#   SECONDS_TO_RUN=60 RESTART_AT=20 PROBE=1 scripts/e2e.d/upgrade-load-selftest.sh
#
# PROBE=1 passes --probe-streams. At the end (unless KEEP=1) its RunSessions and
# registrations are deleted, then the namespace (the playground's control plane has no
# namespace controller: it is finalized here). Output: $OUT_DIR (default a temp dir).
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${PRISM_API:?source .dev/env first (scripts/dev up)}"
run_for="${SECONDS_TO_RUN:-30}"
restart_at="${RESTART_AT:-}"
restart_cmd="${RESTART_CMD:-kill -TERM \$(cat .dev/operator.pid) && while kill -0 \$(cat .dev/operator.pid) 2>/dev/null; do sleep 0.1; done && scripts/dev up}"
out="${OUT_DIR:-$(mktemp -d /tmp/upgrade-load.XXXXXX)}"
suffix="$(head -c 3 /dev/urandom | od -An -tx1 | tr -d ' \n')"
ns="upg-selftest-$suffix"
# (server_instance_id, component_kind) is unique across the cluster (SPEC §3.2): per run.
servers="srv-upg-$suffix-a,srv-upg-$suffix-b"
log() { printf '[upgrade-load-selftest] %s\n' "$*" >&2; }

python="$(scripts/mcp-sdk)"
kubectl create namespace "$ns" >/dev/null
cleanup() {
  [ "${KEEP:-0}" = 1 ] && return
  timeout 60 kubectl -n "$ns" delete runsessions.prism.ntecdev.ai,controllerregistrations.prism.ntecdev.ai --all >/dev/null 2>&1 || true
  kubectl delete namespace "$ns" --wait=false >/dev/null 2>&1 || true
  sleep 2
  if kubectl get namespace "$ns" >/dev/null 2>&1; then
    kubectl get namespace "$ns" -o json | python3 -c 'import json,sys; n=json.load(sys.stdin); n["spec"]["finalizers"]=[]; print(json.dumps(n))' |
      kubectl replace --raw "/api/v1/namespaces/$ns/finalize" -f - >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT
kubectl -n "$ns" create serviceaccount loader >/dev/null
kubectl -n "$ns" create role prism-agent --resource=controllerregistrations.prism.ntecdev.ai \
  --verb=create,delete,get,list >/dev/null
kubectl -n "$ns" create role prism-enqueue --resource=runsessions.prism.ntecdev.ai --verb=get,list,update >/dev/null
kubectl -n "$ns" create rolebinding loader-agent --role=prism-agent --serviceaccount="$ns:loader" >/dev/null
kubectl -n "$ns" create rolebinding loader-enqueue --role=prism-enqueue --serviceaccount="$ns:loader" >/dev/null
for s in ${servers//,/ }; do
  key="$(prism-operator credential new --key-file "$out/$s.key" 2>/dev/null | awk '/publicKey:/ {print $2}')"
  kubectl apply -f - >/dev/null <<EOF
apiVersion: prism.ntecdev.ai/v1alpha1
kind: RunSession
metadata: {name: $s-run, namespace: $ns}
spec:
  serverInstanceId: $s
  componentKind: run
  credential: {publicKey: "$key", generation: 1}
EOF
done
kubectl -n "$ns" create token loader --duration=1h --audience prism-operator > "$out/token"

log "namespace $ns, output in $out, ${run_for} s${restart_at:+, restart at ${restart_at} s}"
rm -f "$out/stop"
"$python" scripts/e2e.d/upgrade-load.py --url "$PRISM_API" --ca "${PRISM_CA_CERT:-}" --token-file "$out/token" \
  --namespace "$ns" --projects 3 --http-agents 2 --mcp-agents 2 --watches 3 --servers "$servers" \
  --component-kind run --rate 2 --stop-file "$out/stop" --out "$out/summary.json" ${PROBE:+--probe-streams} > "$out/stdout" &
load=$!
for _ in $(seq 1 300); do grep -q READY "$out/stdout" 2>/dev/null && break; kill -0 "$load" || break; sleep 0.1; done
grep -q READY "$out/stdout" || { log "no READY within 30 s"; touch "$out/stop"; wait "$load" || true; exit 1; }
log "READY"
start=$(date +%s)
if [ -n "$restart_at" ]; then
  sleep "$restart_at"
  log "restarting the operator: $restart_cmd"
  bash -c "$restart_cmd" >&2
  log "restarted"
fi
left=$(( run_for - ($(date +%s) - start) ))
[ "$left" -gt 0 ] && sleep "$left"
touch "$out/stop"
wait "$load"
log "summary: $out/summary.json"
