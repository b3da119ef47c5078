#!/usr/bin/env bash
# Create (or reuse) a Cloud TPU VM or pod slice, install this checkout on every worker, start a stage on all
# of them, watch its logs, stop it, delete the slice. See launch/README.md.
#
#   launch/tpu.sh create                     # the slice named $TPU_NAME, if it does not exist yet
#   launch/tpu.sh install                    # copy this checkout to every worker, pip install it (+ libtpu)
#   launch/tpu.sh start imitation experiments/configs/imitation.py:qwen7b --workdir=/mnt/gcs/run1 [--config.x=y ...]
#   launch/tpu.sh watch [run]                # follow worker 0's log (WORKERS=all: last lines of every worker)
#   launch/tpu.sh stop [run]                 # stop the run on every worker
#   launch/tpu.sh status | ssh [cmd] | delete
#
# Settings (environment): TPU_NAME, ZONE, PROJECT, ACCELERATOR (v5p-128, v6e-256, ...), RUNTIME (the TPU VM
# software version), SPOT=1 or RESERVED=1, REMOTE_DIR (where the checkout goes on the workers), RUN (a run
# name for logs; default: the stage), PYTHON (on the workers).
set -euo pipefail

TPU_NAME="${TPU_NAME:-histeve}"
ZONE="${ZONE:-us-east5-a}"
PROJECT="${PROJECT:-$(gcloud config get-value project 2>/dev/null)}"
ACCELERATOR="${ACCELERATOR:-v5p-128}"
case "$ACCELERATOR" in
  v6e-*) default_runtime=v2-alpha-tpuv6e ;;
  v5p-*) default_runtime=v2-alpha-tpuv5 ;;
  v5litepod-*) default_runtime=v2-alpha-tpuv5-lite ;;
  *) default_runtime=tpu-ubuntu2204-base ;;
esac
RUNTIME="${RUNTIME:-$default_runtime}"
REMOTE_DIR="${REMOTE_DIR:-histeve-jax}"
PYTHON="${PYTHON:-python3}"
JAX_VERSION="0.10.2"  # pinned in pyproject.toml; libtpu comes with jax[tpu] of the same version
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

tpu() { gcloud compute tpus tpu-vm "$@" --zone="$ZONE" --project="$PROJECT"; }
on_workers() {  # on_workers <worker|all> <command>
  tpu ssh "$TPU_NAME" --worker="$1" --command="$2"
}
exists() { tpu describe "$TPU_NAME" --format="value(state)" >/dev/null 2>&1; }
n_workers() { tpu describe "$TPU_NAME" --format="value(networkEndpoints.len())"; }

cmd_create() {
  if exists; then
    echo "tpu.sh: $TPU_NAME exists ($(tpu describe "$TPU_NAME" --format='value(state)')); reusing it"
    return
  fi
  flags=(--accelerator-type="$ACCELERATOR" --version="$RUNTIME")
  [ "${SPOT:-0}" = 1 ] && flags+=(--spot)
  [ "${RESERVED:-0}" = 1 ] && flags+=(--reserved)
  echo "tpu.sh: creating $TPU_NAME ($ACCELERATOR, $RUNTIME) in $ZONE"
  tpu create "$TPU_NAME" "${flags[@]}"
}

cmd_install() {
  # The tracked files of this checkout (plus uncommitted edits to them), not a clone: what runs is what
  # was tested here.
  tarball="$(mktemp -t histeve-XXXX.tar.gz)"
  (cd "$here" && git ls-files -z | tar --null -czf "$tarball" -T -)
  tpu scp "$tarball" "$TPU_NAME:histeve.tar.gz" --worker=all
  rm -f "$tarball"
  on_workers all "set -e; mkdir -p $REMOTE_DIR ~/logs && tar -xzf histeve.tar.gz -C $REMOTE_DIR && \
    $PYTHON -m pip install --quiet --upgrade pip && \
    $PYTHON -m pip install --quiet 'jax[tpu]==$JAX_VERSION' \
      -f https://storage.googleapis.com/jax-releases/libtpu_releases.html && \
    $PYTHON -m pip install --quiet -e $REMOTE_DIR && \
    $PYTHON -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.devices()[0].device_kind)'"
}

cmd_start() {
  [ $# -ge 2 ] || { echo "usage: tpu.sh start <stage> <config> [--workdir=/shared/path] [--config.k=v ...]" >&2; exit 2; }
  stage="$1"; config="$2"; shift 2
  run="${RUN:-$stage}"
  extra=("$@")
  # Several workers form one jax program: switch on jax.distributed (it finds the coordinator itself).
  if [ "$(n_workers)" -gt 1 ]; then
    extra+=(--config.distributed=on)
    case " ${extra[*]} " in
      *" --workdir=gs://"*) echo "tpu.sh: --workdir must be a mounted path (gcsfuse or NFS), not gs://" >&2; exit 2 ;;
      *" --workdir="*) ;;
      *) echo "tpu.sh: warning: a multi-host run needs a --workdir that every worker mounts" >&2 ;;
    esac
  fi
  args="$(printf ' %q' "${extra[@]}")"
  on_workers all "cd $REMOTE_DIR && mkdir -p ~/logs && \
    nohup $PYTHON -m experiments.$stage --config=$config$args > ~/logs/$run.log 2>&1 < /dev/null & \
    echo \$! > ~/logs/$run.pid; echo \"worker \$(hostname): pid \$(cat ~/logs/$run.pid), log ~/logs/$run.log\""
}

cmd_watch() {
  run="${1:-${RUN:-imitation}}"
  if [ "${WORKERS:-0}" = all ]; then
    on_workers all "echo == \$(hostname); tail -n ${LINES_PER_WORKER:-20} ~/logs/$run.log"
  else
    on_workers 0 "tail -n 100 -F ~/logs/$run.log"
  fi
}

cmd_stop() {
  run="${1:-${RUN:-imitation}}"
  # The recorded pid first; then any straggler of the same program (e.g. grain workers it left behind).
  on_workers all "if [ -f ~/logs/$run.pid ]; then kill \$(cat ~/logs/$run.pid) 2>/dev/null || true; fi; \
    sleep 5; pkill -f 'python3? -m experiments\\.' || true; rm -f ~/logs/$run.pid; echo \"\$(hostname) stopped\""
}

cmd_status() {
  tpu describe "$TPU_NAME" --format="table(name,state,acceleratorType,runtimeVersion,networkEndpoints.len())"
  on_workers all "echo \$(hostname): \$(pgrep -fc 'python3? -m experiments\\.' || true) experiment processes"
}

cmd_ssh() { on_workers "${WORKER:-0}" "${*:-bash -l}"; }

cmd_delete() { tpu delete "$TPU_NAME" --quiet; }

sub="${1:-}"
[ -n "$sub" ] || { sed -n '2,16p' "$0"; exit 2; }
shift
case "$sub" in
  create|install|start|watch|stop|status|ssh|delete) "cmd_$sub" "$@" ;;
  *) echo "tpu.sh: unknown command $sub" >&2; sed -n '2,16p' "$0"; exit 2 ;;
esac
