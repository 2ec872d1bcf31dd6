#!/usr/bin/env bash
# Waits for a Kubernetes Job to end, TIMEOUT (kubectl's: 30m, 24h; 24h if not given) at most: exits 0 once it has
# completed, 1 once it has failed (its backoffLimit spent) or when the time is up. `kubectl wait` takes one condition,
# and a wait for `complete` alone waits out its whole timeout for a job that failed in its first minute.
#   k8s/wait-job.sh job/prepare-openwebtext 24h
job=${1:?usage: k8s/wait-job.sh job/NAME [TIMEOUT]}
timeout=${2:-24h}
kubectl get "$job" -o name >/dev/null || exit 1  # kubectl's line says what is wrong (no such job, no cluster)
kubectl wait --for=condition=complete --timeout="$timeout" "$job" >/dev/null 2>&1 & complete=$!
kubectl wait --for=condition=failed --timeout="$timeout" "$job" >/dev/null 2>&1 & failed=$!
# until the first of them ends (the job has, or the time is up): polled, as macOS's bash 3.2 has no `wait -n`
while kill -0 "$complete" 2>/dev/null && kill -0 "$failed" 2>/dev/null; do sleep 1; done
kill "$complete" "$failed" 2>/dev/null
kubectl wait --for=condition=complete --timeout=0 "$job" 2>/dev/null && exit 0
if kubectl wait --for=condition=failed --timeout=0 "$job" >/dev/null 2>&1; then
    echo "error: $job failed: kubectl logs $job says why; kubectl delete $job before applying it again" >&2
else
    echo "error: $job has not ended in $timeout: it runs on; wait again, or look with kubectl logs $job" >&2
fi
exit 1
