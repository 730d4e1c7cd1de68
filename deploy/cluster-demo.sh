#!/usr/bin/env bash
# `make cluster-demo`: a 3-master Redis Cluster and two hcache replicas on this machine, for a
# first try of scale-out. Everything lives under one temporary directory and stops on Ctrl-C.
#   hcache chat --target 127.0.0.1:50051,127.0.0.1:50052   (sessions routed by rendezvous hashing)
#   hcache chat --target 127.0.0.1:50052 --session ID        (continue it on the other replica)
set -euo pipefail
HCACHE=${HCACHE:-hcache}
REDIS_PORTS=${REDIS_PORTS:-"27001 27002 27003"}  # each needs its port + 10000 free (cluster bus)
GRPC_PORTS=${GRPC_PORTS:-"50051 50052"}
HTTP_PORTS=(${HTTP_PORTS:-8001 8002})
# the replicas share this machine's cores: half each, or their torch thread teams spin
# against each other and every turn waits
THREADS=${THREADS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}
ROOT=$(mktemp -d -t hcache-cluster-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  echo "stopped; logs and data under $ROOT"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

nodes=()
for p in $REDIS_PORTS; do
  mkdir -p "$ROOT/redis-$p"
  redis-server --port "$p" --bind 127.0.0.1 --dir "$ROOT/redis-$p" --cluster-enabled yes \
    --cluster-config-file nodes.conf --appendonly yes --maxmemory-policy volatile-lru \
    >"$ROOT/redis-$p/redis.log" 2>&1 &
  PIDS+=($!)
  nodes+=("127.0.0.1:$p")
done
for p in $REDIS_PORTS; do
  until redis-cli -p "$p" ping >/dev/null 2>&1; do sleep 0.1; done
done
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$ROOT/cluster-create.log"
until redis-cli -p "${REDIS_PORTS%% *}" cluster info | grep -q cluster_state:ok; do sleep 0.2; done
url="redis://$(IFS=,; echo "${nodes[*]}")"
echo "Redis Cluster up: $url"

i=0
targets=()
for g in $GRPC_PORTS; do
  "$HCACHE" serve --port "$g" --http-port "${HTTP_PORTS[$i]}" --dirs "$ROOT/replica-$g" \
    --cluster "$url" --replica-name "replica-$g" --threads "$THREADS" >"$ROOT/replica-$g.log" 2>&1 &
  PIDS+=($!)
  targets+=("127.0.0.1:$g")
  echo "replica-$g: gRPC 127.0.0.1:$g, dashboard http://127.0.0.1:${HTTP_PORTS[$i]}/dashboard (log $ROOT/replica-$g.log)"
  i=$((i + 1))
done
echo "starting the replicas (the first start profiles this machine, about a minute)..."
for g in $GRPC_PORTS; do
  until grep -q "hcache: serving" "$ROOT/replica-$g.log" 2>/dev/null; do
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { echo "a process died; see $ROOT"; exit 1; }; done
    sleep 1
  done
done
echo
echo "ready. In another terminal:"
echo "  $HCACHE chat --target $(IFS=,; echo "${targets[*]}")"
echo "then continue the session it prints on either replica: --target ${targets[1]} --session ID"
echo "Ctrl-C stops everything."
wait
