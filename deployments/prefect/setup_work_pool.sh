#!/usr/bin/env bash
# Prefect set-up for training with Lambda actors: the work pool `nitro-lambda` that prefect.yaml's
# `lambda-actors` deployment targets, and a worker on the learner machine.
#
# The learner (the flow run) runs on the worker's machine; only the actors run on Lambda. A
# `process` pool is therefore the right type: the flow run needs the learner's CPU/GPU and a
# route to Redis, and it invokes the functions itself with one shared boto3 client.
#
# Usage (on the learner machine, repository root, venv active, PREFECT_API_URL set):
#   REDIS_HOST=master.nitro.xxxxxx.use1.cache.amazonaws.com AWS_REGION=us-east-1 \
#     deployments/prefect/setup_work_pool.sh
# Then start a worker with the learner's secrets in ITS environment (never in the pool template):
#   export NITRO_REDIS_PASSWORD=...   # the nitro-learner ACL user's password (e.g. from Secrets Manager)
#   prefect worker start --pool nitro-lambda
set -euo pipefail
cd "$(dirname "$0")/../.."

POOL="${POOL:-nitro-lambda}"
AWS_REGION="${AWS_REGION:-us-east-1}"
REDIS_HOST="${REDIS_HOST:?set REDIS_HOST to the Redis endpoint the actors and the learner reach}"
CA_FILE="${NITRO_REDIS_CA:-/etc/nitro/redis-ca.pem}"

template="$(mktemp)"
trap 'rm -f "$template"' EXIT
python - "$template" <<PY
import json, sys
t = json.load(open("deployments/prefect/lambda-pool-template.json"))
env = t["variables"]["properties"]["env"]["default"]
env["AWS_REGION"] = "${AWS_REGION}"
env["NITRO_REDIS_URL"] = "rediss://nitro-learner@${REDIS_HOST}:6379/0?ssl_ca_certs=${CA_FILE}"
json.dump(t, open(sys.argv[1], "w"), indent=2)
PY

if prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  prefect work-pool update "$POOL" --base-job-template "$template"
else
  prefect work-pool create "$POOL" --type process --base-job-template "$template"
fi
# Keep runs of one pool from piling up on the learner machine: one training run at a time.
prefect work-pool set-concurrency-limit "$POOL" 1

prefect deploy --name lambda-actors
echo "work pool $POOL ready; start a worker: prefect worker start --pool $POOL"
