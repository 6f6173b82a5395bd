#!/usr/bin/env bash
# A/B of two builds in one device call: the device's own speed moves by 20 % or more between calls, so a
# change is judged only against the build without it, measured in the same call, rounds interleaved.
# Here (the machine you work on):  git diff BASE -- src include python > .device/ab.patch
# On the device (carry=[".device"]):  bash bench/gpu/ab.sh ROUNDS 'tether bench ...'
# "new" is this tree; "old" is this tree with .device/ab.patch reversed; each is installed with pip
# --target into its own folder and run first on PYTHONPATH and PATH (neither from site-packages: a build
# loaded otherwise than the other moved NIXL/UCX's unchanged rows by 1.3-1.6x). The builds take turns going first. Logs in $OUT/ab_{new,old}_ROUND.log;
# the table rows are printed, then per row the medians, their ratio and the rounds the new build won
# (ab_table.py), with both processes' CPU-seconds per GB where the table shows CPU%.
# AB_ENV="NAME=VALUE ..." instead of a patch: one build, and "new" is the same build run with that
# environment (an option or an experiment's knob, judged the same way).
# AB_OLD=.device/old.tar instead of a patch: "old" is that tree (`git archive -o .device/old.tar COMMIT`),
# for a build further back than a patch reverses cleanly (across renames and moved files).
set -u
ROUNDS=${1:-2}; CMD=$2; AB_ENV=${AB_ENV:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export COLUMNS=${COLUMNS:-220}  # wide enough that the table keeps its CPU% columns
# AB_BUILT=1: both builds are in place from an earlier run of this script in the same call (tests ran between).
if [ -n "${AB_BUILT:-}" ]; then
  [ -n "$AB_ENV" ] || [ -d /tmp/ab-oldsite/tether ] || { echo "AB_BUILT but no old build in /tmp/ab-oldsite"; exit 1; }
  [ -n "$AB_ENV" ] || [ -d /tmp/ab-newsite/tether ] || { echo "AB_BUILT but no new build in /tmp/ab-newsite"; exit 1; }
elif [ -n "$AB_ENV" ]; then
  python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
else
  rm -rf /tmp/ab-old /tmp/ab-oldsite && mkdir /tmp/ab-old
  if [ -n "${AB_OLD:-}" ]; then
    tar -xf "$AB_OLD" -C /tmp/ab-old || { echo "AB_OLD=$AB_OLD: not a tar of a tree"; exit 1; }
  else
    [ -s .device/ab.patch ] || { echo "no .device/ab.patch: git diff BASE -- src include python > .device/ab.patch"; exit 1; }
    tar --exclude=./.device --exclude=./build -cf - . | tar -xf - -C /tmp/ab-old
    (cd /tmp/ab-old && patch -s -R -p1 < "$OLDPWD/.device/ab.patch") || { echo ".device/ab.patch does not reverse here"; exit 1; }
  fi
  (cd /tmp/ab-old && python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/ab-oldsite . > "$OUT/build_old.log" 2>&1) &
  rm -rf /tmp/ab-newsite
  python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/ab-newsite . > "$OUT/build.log" 2>&1 ||
    { tail -20 "$OUT/build.log"; exit 1; }
  wait
  [ -d /tmp/ab-oldsite/tether ] || { echo "old build failed"; tail -20 "$OUT/build_old.log"; exit 1; }
fi
for r in $(seq 1 "$ROUNDS"); do
  # Odd rounds run the new build first, even rounds the old: whichever runs second in a round has been
  # faster on the GPU host (docs/PERFORMANCE.md, "How we measure"), so a fixed order biases the verdict.
  order="new old"; [ $((r % 2)) = 0 ] && order="old new"
  for v in $order; do
    envs=""
    if [ $v = new ]; then envs=$AB_ENV; fi
    if [ -z "$AB_ENV" ]; then envs="PYTHONPATH=/tmp/ab-${v}site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/ab-${v}site/bin:$PATH"; fi
    env $envs python3 -c "import tether; print('tether from', tether.__file__)" > "$OUT/ab_${v}_$r.log" 2>&1
    env $envs timeout 300 bash -c "$CMD" >> "$OUT/ab_${v}_$r.log" 2>&1
    echo "== $v round $r rc=$? ${envs:+[$envs] }($(head -1 "$OUT/ab_${v}_$r.log"))"
    grep -a "│ *\(write\|read\|send\)\|^-- " "$OUT/ab_${v}_$r.log" | cut -c1-140
  done
done
python3 "$(dirname "$0")/ab_table.py" "$OUT"
