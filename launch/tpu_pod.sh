#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM slice (e.g. v5p-64: 8 workers x 4 chips).
#
#   launch/tpu_pod.sh --tpu=k3 --zone=us-east5-a [--project=P] \
#       [--create=v5p-64 --runtime=v2-alpha-tpuv5 [--spot]] \
#       -- --config=experiments/k3_small.py --workdir=/mnt/k3/runs/k3_small
#
# 1. with --create: requests the slice as a queued resource and waits until it is ACTIVE;
# 2. copies this working tree (uncommitted changes included, no .git or venvs) to
#    ~/k3jax on every worker and creates ~/k3jax/.venv there with `pip install -e .` and
#    jax[tpu];
# 3. runs `python -m k3jax.train <flags after -->` on all workers at once
#    (`gcloud compute tpus tpu-vm ssh --worker=all`). JAX finds the other workers from the
#    TPU VM metadata (k3jax/parallel/distributed.py); process 0 prints the log.
#
# The run lives as long as this ssh session: start it inside tmux or screen. --workdir must be
# one directory that every worker sees (a GCS bucket mounted with gcsfuse at the same path,
# or Filestore): every worker writes its shards of each checkpoint there. Rerunning the
# command resumes from the newest checkpoint (add --skip_setup to reuse the copied tree).
# One slice; several slices over DCN (multi-slice): launch/gke_jobset.yaml with replicas = N
# and --config.mesh.dcn_data=N (check first: python -m k3jax.aot ... --num_slices=N).
set -euo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

tpu= zone= project= create= runtime= spot= skip_setup=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tpu=*) tpu="${1#*=}" ;;
    --zone=*) zone="${1#*=}" ;;
    --project=*) project="${1#*=}" ;;
    --create=*) create="${1#*=}" ;;
    --runtime=*) runtime="${1#*=}" ;;
    --spot) spot=1 ;;
    --skip_setup) skip_setup=1 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "tpu_pod.sh: unknown argument $1 (the k3jax.train flags go after --)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$tpu" ]] || { echo "tpu_pod.sh: --tpu=NAME is required" >&2; exit 2; }
[[ -n "$zone" ]] || { echo "tpu_pod.sh: --zone=ZONE is required" >&2; exit 2; }
[[ $# -gt 0 ]] || { echo "tpu_pod.sh: pass the k3jax.train flags after --" >&2; exit 2; }
if [[ -n "$create" && -z "$runtime" ]]; then
  echo "tpu_pod.sh: --create needs --runtime (the TPU VM software version, e.g. v2-alpha-tpuv5)" >&2
  exit 2
fi

where=(--zone="$zone")
[[ -z "$project" ]] || where+=(--project="$project")
repo="$(cd "$(dirname "$0")/.." && pwd)"

if [[ -n "$create" ]]; then
  gcloud compute tpus queued-resources create "$tpu" --node-id="$tpu" "${where[@]}" \
      --accelerator-type="$create" --runtime-version="$runtime" ${spot:+--spot}
  echo "tpu_pod.sh: waiting for queued resource $tpu to become ACTIVE ..."
  while true; do
    state="$(gcloud compute tpus queued-resources describe "$tpu" "${where[@]}" \
        --format='value(state.state)')"
    case "$state" in
      ACTIVE) break ;;
      FAILED|SUSPENDED) echo "tpu_pod.sh: queued resource $tpu is $state" >&2; exit 1 ;;
    esac
    sleep 30
  done
fi

ssh_all() {
  gcloud compute tpus tpu-vm ssh "$tpu" "${where[@]}" --worker=all --command="$1"
}

if [[ -z "$skip_setup" ]]; then
  tarball="$(mktemp -t k3jax.XXXXXX).tar.gz"
  trap 'rm -f "$tarball"' EXIT
  tar -C "$repo" -czf "$tarball" --exclude=.git --exclude='.venv*' --exclude=__pycache__ \
      --exclude='*.egg-info' .
  gcloud compute tpus tpu-vm scp "$tarball" "$tpu":k3jax.tar.gz "${where[@]}" --worker=all
  ssh_all 'set -e; rm -rf ~/k3jax && mkdir -p ~/k3jax && tar -C ~/k3jax -xzf ~/k3jax.tar.gz
    python3 -m venv ~/k3jax/.venv
    ~/k3jax/.venv/bin/pip install -q --upgrade pip
    ~/k3jax/.venv/bin/pip install -q -e ~/k3jax "jax[tpu]>=0.10.2,<0.12"'
fi

ssh_all "cd ~/k3jax && .venv/bin/python -m k3jax.train $(printf '%q ' "$@")"
