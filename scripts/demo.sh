#!/usr/bin/env bash
# The main job: a DeepSeek-V3-shaped MLA batch through mlarope on the best device present,
# checked against the reference and timed. Extra arguments go to `python -m mlarope demo`.
source "$(dirname "$0")/_env.sh"
python -m mlarope demo "$@"
