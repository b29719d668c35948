#!/usr/bin/env bash
# Prove the serve image runs, on a machine with no container registry (not part of CI).
#
# 1. start a Docker engine if none answers (Debian's docker.io: dockerd --bridge=none
#    --iptables=false; containers then use the host network),
# 2. debootstrap a minimal Debian with Python 3.11 and import it under the base image's tag
#    (python:3.11-slim-bookworm), so `docker build` needs no registry,
# 3. build the `serve` target, train a digits model, run the image with the model mounted
#    read-only, wait for /readyz, make one classify call, stop it with SIGTERM.
#
# 4. with TRAIN=1: build the `train` target (TORCH_INDEX_URL passes through as the build
#    argument of that name when set), train digits inside it, then run torchrun with 2
#    processes inside it and check the manifest says world_size 2.
#
# Usage: make install && sudo [TRAIN=1] deploy/smoke-image.sh
#   (run from the repository root; needs apt-get; the host-side steps run the project's
#   .venv/bin/python, or PYTHON=/path/to/python with the train extra installed)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/tmp/ncaknn-smoke}
BASE_TAG=python:3.11-slim-bookworm
PORT=${PORT:-18080}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$WORK"
if ! "$PYTHON" -c "import training, service" 2>/dev/null; then
  echo "error: $PYTHON cannot import the project: run 'make install' first, or set PYTHON" >&2
  exit 2
fi

log() { printf '\n== %s\n' "$*"; }

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  command -v dockerd >/dev/null || { apt-get update -qq && apt-get install -y -qq docker.io >/dev/null; }
  nohup dockerd --bridge=none --iptables=false --ip6tables=false --data-root "$WORK/docker" \
    >"$WORK/dockerd.log" 2>&1 &
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null
fi
docker version --format 'docker engine {{.Server.Version}}'

if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  log "building the base image $BASE_TAG with debootstrap"
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
  ROOTFS="$WORK/rootfs"
  rm -rf "$ROOTFS"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" >"$WORK/debootstrap.log"
  chroot "$ROOTFS" python3 -m venv /opt/venv
  # the host's CA bundle, in case this network inspects TLS
  cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
  tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$BASE_TAG" >/dev/null
fi
docker run --rm --network host "$BASE_TAG" python --version

log "docker build --target serve"
docker build --network host --target serve -t nca-knn:serve . 2>&1 | tail -n 5
docker image inspect nca-knn:serve --format 'image {{.Id}} user={{.Config.User}} size={{.Size}} bytes'
docker run --rm --network host --entrypoint python nca-knn:serve -c \
  "import importlib.util, sys; print('torch in image:', importlib.util.find_spec('torch') is not None)"

log "training a digits model on the host"
MODEL="$WORK/models/digits"
[ -f "$MODEL/manifest.json" ] || "$PYTHON" -m training --data digits --n-components 32 --out "$MODEL" --quiet --no-plots
chmod -R a+rX "$WORK/models"

log "running the image with the model mounted read-only"
docker rm -f ncaknn-smoke >/dev/null 2>&1 || true
docker run -d --name ncaknn-smoke --network host --read-only --tmpfs /tmp \
  -e NCAKNN_PORT="$PORT" -v "$MODEL:/models/current:ro" nca-knn:serve >/dev/null
for _ in $(seq 1 60); do
  if "$PYTHON" -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$PORT/readyz', timeout=1).status != 200)" 2>/dev/null; then break; fi
  sleep 1
done
echo "readyz: $("$PYTHON" -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:$PORT/readyz').read().decode())")"
"$PYTHON" - "$PORT" <<'PY'
import json, sys, urllib.request
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
body = json.dumps({"instances": X[:3].tolist(), "k": 5}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/classify", data=body, headers={"content-type": "application/json"})
answer = json.load(urllib.request.urlopen(req))
print("classify:", [p["label"] for p in answer["predictions"]], "true:", y[:3].tolist(), "model", answer["model_version"])
PY
for _ in $(seq 1 30); do  # until a HEALTHCHECK (every 10 s) has passed
  [ "$(docker inspect ncaknn-smoke --format '{{.State.Health.Status}}')" = healthy ] && break
  sleep 2
done
docker inspect ncaknn-smoke --format 'health: {{.State.Health.Status}}'

log "docker stop (SIGTERM, drain)"
docker stop -t 30 ncaknn-smoke >/dev/null
docker inspect ncaknn-smoke --format 'exit code {{.State.ExitCode}}'
docker logs ncaknn-smoke 2>&1 | tail -n 4
docker rm ncaknn-smoke >/dev/null

if [ "${TRAIN:-0}" = 1 ]; then
  log "docker build --target train"
  docker build --network host --target train \
    ${TORCH_INDEX_URL+--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"} -t nca-knn:train . 2>&1 | tail -n 5
  docker image inspect nca-knn:train --format 'image {{.Id}} user={{.Config.User}} size={{.Size}} bytes'
  OUT="$WORK/train-out"
  rm -rf "$OUT" && mkdir -p "$OUT" && chmod 777 "$OUT"
  log "training digits inside the train image (read-only root filesystem)"
  docker run --rm --network host --read-only --tmpfs /tmp -v "$OUT:/out" nca-knn:train \
    --data digits --out /out/digits --quiet --no-plots
  log "torchrun with 2 processes inside the train image"
  docker run --rm --network host --read-only --tmpfs /tmp -v "$OUT:/out" --entrypoint torchrun \
    nca-knn:train --standalone --nproc_per_node 2 -m training --data digits --out /out/digits-2 \
    --quiet --no-plots
  log "the native kernels run inside the train image (built in its wheel, no compiler)"
  docker run --rm --network host --read-only --tmpfs /tmp --entrypoint python nca-knn:train -c \
    "import warnings; from sklearn.datasets import make_blobs; from training import NCA; \
X, y = make_blobs(600, n_features=6, centers=3, random_state=0); warnings.simplefilter('ignore'); \
a = NCA(n_components=2, max_iter=3, n_candidates=4, random_state=0).fit(X, y).kernels_; \
b = NCA(n_components=2, max_iter=2, objective='knca-majority', k=3, n_candidates=4, random_state=0).fit(X, y).kernels_; \
assert a == {'nca_exact': 'c', 'nca_candidates': 'c'} and b == {'knca': 'c'}, ('the fast path did not load', a, b); \
print('kernels', a, b)"
  "$PYTHON" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
one, two = (json.loads((Path(sys.argv[1]) / d / "manifest.json").read_text()) for d in ("digits", "digits-2"))
assert one["training"]["world_size"] == 1 and two["training"]["world_size"] == 2, (one["training"], two["training"])
print("train image: world_size", one["training"]["world_size"], "and", two["training"]["world_size"],
      "test accuracy", one["metrics"]["test_accuracy_at_default_k"], two["metrics"]["test_accuracy_at_default_k"],
      "kernels", one["training"]["kernels"])
PY
fi
log "smoke test passed"
