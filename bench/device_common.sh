# Shared by bench/device_*.sh (sourced): environment, the output folder and `step NAME CMD...`,
# which runs CMD with its output in $OUT/NAME.log, then prints the log's last $TAIL lines and
# the exit status and seconds.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
step() { local name=$1; shift; echo "=== $name"; local t0=$SECONDS; "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -n "${TAIL:-8}" "$OUT/$name.log"; echo "=== $name rc=$rc in $((SECONDS - t0)) s"; }
