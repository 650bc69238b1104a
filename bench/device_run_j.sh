#!/usr/bin/env bash
# Session 2: final decode roofline (event-timed copy bandwidth), PDL off/on, with the breakdown.
source "$(dirname "$0")/device_common.sh"
TAIL=9 step roofline python3 -m bench.decode_roofline --breakdown --out "$OUT/roofline.json"
TAIL=9 step roofline_again python3 -m bench.decode_roofline --pdl on --out "$OUT/roofline_again.json"
exit 0
