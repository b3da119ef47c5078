#!/usr/bin/env bash
# The RL actors' Ray cluster on Compute Engine: a head VM, CPU actor VMs that run only games, and inference
# hosts (TPU VMs, or GPU VMs) that join with the Ray resource the policy servers ask for
# (config.server.resource, "accelerator" in rl.py:qwen7b). See launch/rl.md.
#
#   launch/ray_cluster.sh create        # head + $ACTOR_HOSTS CPU VMs (+ $INFERENCE_HOSTS TPU VMs), install
#   launch/ray_cluster.sh start         # ray start on every VM (head first), the resource on inference hosts
#   launch/ray_cluster.sh run [--config.k=v ...]   # experiments.rl --config.role=actors on the head
#   launch/ray_cluster.sh watch | status | stop | delete
#
# Settings (environment): CLUSTER (name prefix), ZONE, PROJECT, ACTOR_HOSTS (number of CPU VMs),
# ACTOR_TYPE (machine type, 32 vCPUs = 64 games), INFERENCE_HOSTS, INFERENCE_ACCELERATOR (v5p-8: one
# 4-chip host), INFERENCE_RUNTIME, RESOURCE (the server's Ray resource), SERVERS_PER_HOST (its units per
# inference host), SHARED (the path every VM mounts: rollouts, learner checkpoints), RAY_PORT, REMOTE_DIR.
# Token authentication: a cluster token is generated once on the head and copied to every VM
# (RAY_AUTH_TOKEN_PATH); keep the Ray ports inside the VPC.
set -euo pipefail

CLUSTER="${CLUSTER:-histeve-actors}"
ZONE="${ZONE:-us-east5-a}"
PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null)}"
ACTOR_HOSTS="${ACTOR_HOSTS:-2}"
ACTOR_TYPE="${ACTOR_TYPE:-n2-standard-32}"
INFERENCE_HOSTS="${INFERENCE_HOSTS:-14}"
INFERENCE_ACCELERATOR="${INFERENCE_ACCELERATOR:-v5p-8}"
INFERENCE_RUNTIME="${INFERENCE_RUNTIME:-v2-alpha-tpuv5}"
RESOURCE="${RESOURCE:-accelerator}"
SERVERS_PER_HOST="${SERVERS_PER_HOST:-1}"
SHARED="${SHARED:-/mnt/gcs/histeve}"
RAY_PORT="${RAY_PORT:-6379}"
REMOTE_DIR="${REMOTE_DIR:-histeve-jax}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

vm() { gcloud compute instances "$@" --zone="$ZONE" --project="$PROJECT"; }
tpu() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
head_vm="$CLUSTER-head"
actor_vms() { for i in $(seq 0 $((ACTOR_HOSTS - 1))); do echo "$CLUSTER-actor-$i"; done; }
inference_vms() { for i in $(seq 0 $((INFERENCE_HOSTS - 1))); do echo "$CLUSTER-inference-$i"; done; }
on_vm() { vm ssh "$1" --command="$2" < /dev/null; }
on_tpu() { tpu ssh "$1" --worker=all --command="$2" < /dev/null; }
head_ip() { vm describe "$head_vm" --format='value(networkInterfaces[0].networkIP)'; }

install_cmd() {  # Debian's minetest + Xvfb for the games (launch/install.sh), this checkout, the shared path
  echo "set -e; mkdir -p $REMOTE_DIR && tar -xzf histeve.tar.gz -C $REMOTE_DIR && bash $REMOTE_DIR/launch/install.sh \
    && sudo mkdir -p $SHARED && (mountpoint -q $SHARED || echo 'mount $SHARED (gcsfuse --implicit-dirs or NFS) before start')"
}

cmd_create() {
  tarball="$(mktemp -t histeve-XXXX.tar.gz)"
  (cd "$here" && git ls-files -z | tar --null -czf "$tarball" -T -)
  for name in "$head_vm" $(actor_vms); do
    vm describe "$name" >/dev/null 2>&1 || vm create "$name" --machine-type="$ACTOR_TYPE" \
      --image-family=debian-12 --image-project=debian-cloud --boot-disk-size=100GB
    vm scp "$tarball" "$name:histeve.tar.gz" && on_vm "$name" "$(install_cmd)"
  done
  for name in $(inference_vms); do
    tpu describe "$name" >/dev/null 2>&1 || tpu create "$name" --accelerator-type="$INFERENCE_ACCELERATOR" \
      --version="$INFERENCE_RUNTIME"
    tpu scp "$tarball" "$name:histeve.tar.gz" --worker=all
    on_tpu "$name" "$(install_cmd) && python3 -m pip install --quiet 'jax[tpu]==0.10.2' \
      -f https://storage.googleapis.com/jax-releases/libtpu_releases.html"
  done
  rm -f "$tarball"
}

cmd_start() {
  # The head runs the GCS and the actors' driver, no games (num-cpus 0); it generates the cluster token.
  on_vm "$head_vm" "ray get-auth-token --generate >/dev/null 2>&1 || true; \
    ray start --head --port=$RAY_PORT --num-cpus=0 --include-dashboard=false --disable-usage-stats"
  token="$(on_vm "$head_vm" 'cat ~/.ray/auth_token')"
  ip="$(head_ip)"
  for name in $(actor_vms); do  # games only: their vCPUs (the fleet reserves half a vCPU per game)
    on_vm "$name" "mkdir -p ~/.ray && echo '$token' > ~/.ray/auth_token && \
      ray start --address=$ip:$RAY_PORT --disable-usage-stats"
  done
  for name in $(inference_vms); do  # the policy servers only: the resource they ask for, no CPUs for games
    on_tpu "$name" "mkdir -p ~/.ray && echo '$token' > ~/.ray/auth_token && \
      ray start --address=$ip:$RAY_PORT --num-cpus=0 --resources='{\"$RESOURCE\": $SERVERS_PER_HOST}' \
      --disable-usage-stats"
  done
  on_vm "$head_vm" "ray status"
}

cmd_run() {  # the actors' driver on the head, until train_minutes; the learner runs on its slice (tpu.sh)
  args="$(printf ' %q' "$@")"
  on_vm "$head_vm" "cd $REMOTE_DIR && mkdir -p ~/logs && nohup python3 -m experiments.rl \
    --config=experiments/configs/rl.py:qwen7b --config.role=actors --config.ray_address=auto \
    --config.workdir=$SHARED/rl-run1 --config.server.resource=$RESOURCE \
    --config.server.replicas=$((INFERENCE_HOSTS * SERVERS_PER_HOST)) $args > ~/logs/actors.log 2>&1 < /dev/null & \
    echo \$! > ~/logs/actors.pid; echo pid \$(cat ~/logs/actors.pid), log ~/logs/actors.log"
}

cmd_watch() { on_vm "$head_vm" "tail -n 100 -F ~/logs/actors.log"; }
cmd_status() { on_vm "$head_vm" "ray status; ls $SHARED/rl-run1/rollouts | tail -5; cat $SHARED/rl-run1/rollouts/learner_status.json"; }

cmd_stop() {  # the driver first (it writes rollouts/DONE: the learner drains and saves), then Ray
  on_vm "$head_vm" "kill -INT \$(cat ~/logs/actors.pid) 2>/dev/null || true; sleep 30; ray stop"
  for name in $(actor_vms); do on_vm "$name" "ray stop"; done
  for name in $(inference_vms); do on_tpu "$name" "ray stop"; done
}

cmd_delete() {
  vm delete "$head_vm" $(actor_vms) --quiet
  for name in $(inference_vms); do tpu delete "$name" --quiet; done
}

sub="${1:-}"
[ -n "$sub" ] || { sed -n '2,17p' "$0"; exit 2; }
shift
case "$sub" in
  create|start|run|watch|status|stop|delete) "cmd_$sub" "$@" ;;
  *) echo "ray_cluster.sh: unknown command $sub" >&2; sed -n '2,17p' "$0"; exit 2 ;;
esac
