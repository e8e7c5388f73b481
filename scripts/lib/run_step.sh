# Sourced by the device check scripts (scripts/device_check.sh, scripts/gpu_pr_eagle3_check.sh).
# run NAME CMD...: run CMD with its output in $OUTDIR/NAME.log; print ok and the log's last $RUN_OK_TAIL lines
# (default 8), or FAILED and its last 30 lines and set status=1. The caller sets OUTDIR and status=0.
run() {
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  if "$@" > "$OUTDIR/$name.log" 2>&1; then
    echo "   ok ($((SECONDS - t0)) s)"; tail -"${RUN_OK_TAIL:-8}" "$OUTDIR/$name.log"
  else
    echo "   FAILED ($((SECONDS - t0)) s)"; tail -30 "$OUTDIR/$name.log"; status=1
  fi
}
